"""Start-up without automatic garbage collections.

Importing torch and building a model allocate millions of objects that live as long as the
process; the collector's full collections, triggered as they pile up, walk all of them again
and again and free nothing (a tenth of a second or more per start on a small CPU). Inside
`collections_paused()` none run; the engine then collects the young generations and freezes
what start-up left (engine/llm_engine.py), and the previous state returns.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collections_paused() -> Iterator[None]:
    """No automatic collections inside; the collector's previous state (on or off) after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
