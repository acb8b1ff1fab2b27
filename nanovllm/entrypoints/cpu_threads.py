"""How many threads torch's CPU operators get in a one-shot command (`generate`, `chat`).

torch runs each operator over all the machine's cores by default, and every operator waits for
all its threads: on a machine where other processes keep cores busy, one thread that is not
scheduled holds up each of the thousands of operators of a step. So a command takes the cores
that the 1-minute load average leaves free, less one core's worth of load (the average lags and
counts commands that just ended), and at least one; `--threads N` or OMP_NUM_THREADS choose
instead. A long-running server keeps torch's own choice.
"""
from __future__ import annotations

import os


def free_cores(cpu_count: int, load_average: float) -> int:
    """The cores a busy machine leaves: cpu_count - (load - 1), rounded, between 1 and cpu_count."""
    return max(1, min(cpu_count, round(cpu_count - max(0.0, load_average - 1.0))))


def command_threads(requested: int | None) -> int | None:
    """The intra-op thread count for this command, or None to leave torch's own choice
    (OMP_NUM_THREADS set, or the load average unknown)."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads must be >= 1, got {requested}")
        return requested
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    try:
        load = os.getloadavg()[0]
    except OSError:
        return None
    return free_cores(os.cpu_count() or 1, load)
