"""Compile the Triton kernels a model will launch in parallel, before they first run.

Why: on a machine whose Triton cache is empty, the first start compiled each kernel variant when
it was first launched, one after another, in the profiling run and the graph capture: about a
third of a cold start. Triton's compiler releases the GIL, so
compiles run side by side in threads.

How: every launch site calls `launch(kernel, grid, ...)` instead of `kernel[grid](...)`. Inside
`precompiling()`, `launch` hands the call to Triton's `warmup` (compile, don't run) under Triton's
AsyncCompileMode, which queues the compile on a thread pool and returns at once. The runner does a
dry pass of the very forwards its start-up runs (same shapes, dtypes and strides, so the same
compiled variants) inside `precompiling()`; leaving it waits for every compile (each compile
thread also builds its kernel's host-side launcher, which older Tritons compile from C). The dry
pass's results are garbage (no Triton kernel ran) and are dropped; the real passes that follow
find every kernel compiled. Where Triton has no AsyncCompileMode, `precompiling` yields False
and the caller skips its dry pass: kernels then compile when first launched.

`compile_in_background` runs such a dry pass on a thread of its own, for a kernel that start-up
need not wait for (the persistent decode kernel, the longest compile).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

# The launches a dry pass on this thread has already handed to Triton (None outside a dry
# pass). A ContextVar, like Triton's own async compile mode.
_dry_pass: ContextVar[set | None] = ContextVar("nanovllm_dry_pass", default=None)


def _launch_key(kernel: Any, args: tuple, kwargs: dict) -> tuple:
    """What can make Triton pick another compiled variant: tensors' dtypes and 16-byte
    alignment, other arguments' values. Finer than Triton's own key (it over-separates, never
    merges), so deduplicating on it only saves repeats such as a model's 28 identical layers."""

    def describe(a: Any) -> tuple:
        if hasattr(a, "data_ptr"):
            return ("tensor", a.dtype, a.data_ptr() % 16)
        if hasattr(a, "block_shape") and hasattr(a, "base"):  # a tensor descriptor (not hashable)
            return ("descriptor", a.base.dtype, tuple(a.shape), tuple(a.block_shape))
        return (type(a).__name__, a)

    return (id(kernel), tuple(map(describe, args)), tuple((k, describe(v)) for k, v in sorted(kwargs.items())))


def compiling_only() -> bool:
    """Whether `launch` only compiles here (inside `precompiling()` or a background dry pass)."""
    return _dry_pass.get() is not None


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """`kernel[grid](*args, **kwargs)`, or only its compilation inside `precompiling()`."""
    seen = _dry_pass.get()
    if seen is None:
        kernel[grid](*args, **kwargs)
        return
    key = _launch_key(kernel, args, kwargs)
    if key not in seen:
        # Triton 3.6 hashes the kernel's source at every warmup in async mode, even for a variant
        # already queued: the graph sizes' dry forwards took 2.5-2.9 s without this, 0.6-1.4 s with it.
        seen.add(key)
        _when_compiled(kernel.warmup(*args, grid=grid, **kwargs), _build_launcher)


def _when_compiled(compiled: Any, then: Callable[[Any], None]) -> None:
    """Run `then(kernel)` on the compile thread once a queued compile (Triton's FutureKernel)
    has produced the kernel. Anything else (a kernel this process compiled before) is skipped."""
    future = getattr(compiled, "future", None)
    if future is None:
        return

    def done(f: Future) -> None:
        if f.exception() is None:
            then(f.result())

    future.add_done_callback(done)


def _build_launcher(kernel: Any) -> None:
    """Build the kernel's host-side launcher now, on the compile thread. Triton builds it at the
    kernel's first real launch, and Triton versions before the generic launcher compile a C stub
    for it there (cached on disk), one after another, in the graph capture of a first start.
    Only a cache warm-up: any failure is left for that first launch to report."""
    try:
        from triton.runtime import driver

        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # noqa: BLE001 - the real launch builds it again and raises properly
        pass


def default_workers() -> int:
    return max(1, min(32, os.cpu_count() or 1))


@contextmanager
def precompiling(max_workers: int | None = None) -> Iterator[bool]:
    """Within the block, Triton launches made through `launch` only queue their compilation;
    the block's end waits for all of them. Yields False (and does nothing) when this Triton
    cannot compile asynchronously."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        yield False
        return
    # ignore_errors: a variant that fails to compile is dropped here and compiled again, raising
    # with its full context, at its first real launch (where it failed before this module existed).
    with ThreadPoolExecutor(max_workers or default_workers(), thread_name_prefix="triton-compile") as pool:
        with AsyncCompileMode(pool, ignore_errors=True):
            token = _dry_pass.set(set())
            try:
                yield True
            finally:
                _dry_pass.reset(token)


def compile_in_background(dry_pass: Callable[[], object]) -> Future:
    """Run `dry_pass` inside `precompiling()` on a thread of its own and return a future that is
    done once every compile it queued is (its result: True, or False where this Triton cannot
    compile asynchronously and nothing was compiled). A failing dry pass sets the exception.

    Not a daemon thread: the interpreter's exit waits for the compile (a few seconds at most)
    rather than tearing the process down under it (a GPU pytest run with a daemon thread printed
    "terminate called without an active exception" at exit; docs/benchmarks.md)."""
    future: Future = Future()

    def work() -> None:
        try:
            with precompiling() as dry:
                if dry:
                    dry_pass()
            future.set_result(dry)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(e)

    threading.Thread(target=work, name="nanovllm-background-compile", daemon=False).start()
    return future
