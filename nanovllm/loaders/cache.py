"""The on-disk cache of what is converted once per model file (docs/startup.md).

Where: `$NANOVLLM_CACHE_DIR`, else `$XDG_CACHE_HOME/nanovllm`, else `~/.cache/nanovllm`;
`NANOVLLM_DISABLE_CACHE=1` turns it off. Entries are keyed by a digest of the source file's
whole content (xxh3-128 over a memory map, a fraction of a second per GB from the page cache), so a copied or
touched file still hits and an edited one never does.

Every file is written to a temporary name beside its destination and renamed into place, so a
reader sees a whole file or none, and concurrent writers of one entry cannot corrupt it (the last
rename wins; both wrote the same bytes). Readers treat an entry that fails to load as absent.
A writer killed mid-write leaves its temporary file; the next write in that directory removes
such leftovers once their process is gone and they are an hour old.
"""
from __future__ import annotations

import logging
import mmap
import os
import re
import shutil
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import xxhash

logger = logging.getLogger("nanovllm")

_DISABLE_VALUES = ("1", "true", "yes", "on")
_TMP_NAME = re.compile(r"\..+\.tmp-(\d+)-[0-9a-f]{8}")  # _tmp_name's: the writer's pid
# A leftover temporary file is removed only this old: on a cache shared between machines, a
# writer elsewhere is not among this machine's processes.
ORPHAN_AGE_S = 3600.0


def cache_enabled() -> bool:
    return os.environ.get("NANOVLLM_DISABLE_CACHE", "").strip().lower() not in _DISABLE_VALUES


def cache_dir() -> Path:
    """The cache's root directory (not created here)."""
    explicit = os.environ.get("NANOVLLM_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "nanovllm"


def file_digest(path: str | os.PathLike[str]) -> str:
    """xxh3-128 hex digest of a file's size and whole content."""
    with open(path, "rb") as f:
        if not os.fstat(f.fileno()).st_size:
            return buffer_digest(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return buffer_digest(m)


def buffer_digest(data) -> str:
    """file_digest of a file holding exactly `data` (bytes, mmap, memoryview)."""
    h = xxhash.xxh3_128(len(data).to_bytes(8, "little"))
    h.update(data)
    return h.hexdigest()


def _tmp_name(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists (another user's)
        return True
    return True


def remove_orphans(directory: Path) -> None:
    """Remove the temporary files and directories that writers killed mid-write left in
    `directory`: those whose process is gone and that are ORPHAN_AGE_S old."""
    try:
        entries = list(directory.iterdir())
    except OSError:
        return
    now = time.time()
    for entry in entries:
        match = _TMP_NAME.fullmatch(entry.name)
        if match is None or _process_alive(int(match.group(1))):
            continue
        try:
            if now - entry.lstat().st_mtime < ORPHAN_AGE_S:
                continue
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        except OSError:
            continue


@contextmanager
def atomic_file(dest: Path) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces `dest` in one rename."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_orphans(dest.parent)
    tmp = _tmp_name(dest)
    try:
        yield tmp
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextmanager
def scratch_dir(dest: Path) -> Iterator[Path]:
    """Yield a temporary directory beside `dest` to build it in (the builder moves its result
    to dest itself); removed on exit, or by a later writer's remove_orphans if the builder is
    killed."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_orphans(dest.parent)
    tmp = _tmp_name(dest)
    tmp.mkdir()
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def atomic_dir(dest: Path) -> Iterator[Path]:
    """Yield a temporary directory to fill; on success it is renamed to `dest`, unless another
    writer got there first (then theirs is kept and ours dropped)."""
    with scratch_dir(dest) as tmp:
        yield tmp
        try:
            os.rename(tmp, dest)
        except OSError:
            if not dest.is_dir():
                raise


def discard(path: Path, why: BaseException) -> None:
    """Drop a cache file or directory that failed to load, so that it is rebuilt."""
    logger.warning("cache entry %s is unreadable (%s: %s); rebuilding it", path, type(why).__name__, why)
    aside = _tmp_name(path)
    try:
        os.rename(path, aside)  # readers stop seeing it at once, whatever the removal takes
    except OSError:
        return
    if aside.is_dir():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)
