"""What this machine's CPU can do, from the kernel's `/proc/cpuinfo` flags (empty elsewhere)."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The first processor's feature flags (e.g. "avx512_bf16", "avx512_vnni"), or none where
    /proc/cpuinfo cannot be read (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()
