"""Where a command's time went, from the process start to the answer (`generate --verbose`).

The parts come from the engine's and the runner's `startup_seconds` and the request's time to
first token; what the command itself measured fills in the rest ("import" is the process start
to the engine's construction: the interpreter, imports and argument parsing).
"""
from __future__ import annotations

import os


def process_age() -> float | None:
    """Seconds since this process started (Linux /proc), or None where that cannot be read."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rpartition(")")[2].split()
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
    except (OSError, ValueError, IndexError):
        return None


def startup_rows(llm, *, import_s: float | None, engine_s: float, first_token_s: float | None,
                 generate_s: float) -> list[tuple[str, float]]:
    """(part, seconds) from the process start to the last token of one generate() call."""
    engine = dict(llm.engine.startup_seconds)
    runner = getattr(getattr(llm.engine.executor, "runner", None), "startup_seconds", {})
    rows: list[tuple[str, float]] = []
    if import_s is not None:
        rows.append(("import", import_s))
    rows.append(("config", engine.get("config", 0.0)))
    rows.append(("tokenizer", engine.get("tokenizer", 0.0)))
    weights = runner.get("load_weights", 0.0)
    kv = sum(runner.get(k, 0.0) for k in ("profile", "dry_passes", "compile_wait", "agree_blocks", "kv_alloc"))
    rows.append(("weights", weights))
    rows.append(("KV pool", kv))
    if "cpu_decode_packages" in runner:  # cpu_compile: its packages built or loaded
        rows.append(("compiled decode", runner["cpu_decode_packages"]))
    accounted = sum(s for name, s in rows if name != "import")
    rows.append(("other engine set-up", max(0.0, engine_s - accounted)))
    if first_token_s is not None:
        rows.append(("first token", first_token_s))
        rows.append(("generation", max(0.0, generate_s - first_token_s)))
    else:
        rows.append(("generation", generate_s))
    return rows


def format_rows(rows: list[tuple[str, float]]) -> str:
    width = max(len(name) for name, _ in rows + [("total", 0.0)])
    lines = [f"{'start-up':<{width}}  seconds"]
    lines += [f"{name:<{width}}  {seconds:7.2f}" for name, seconds in rows]
    lines.append(f"{'total':<{width}}  {sum(s for _, s in rows):7.2f}")
    return "\n".join(lines)

