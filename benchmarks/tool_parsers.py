"""What the tool-call and reasoning parsers cost the server's front-end per streamed delta.

    python benchmarks/tool_parsers.py [--calls 4] [--argument-chars 2000] [--delta-chars 4] [--iters 5]

An output of `--calls` Hermes calls (`<tool_call>{"name", "arguments"}</tool_call>`, each
with about `--argument-chars` characters of arguments) after a `<think>` block and a sentence
of content is fed to `ChoiceParser` in deltas of `--delta-chars` characters (about one token
each), as a stream is, and whole, as an unstreamed request is. Per configuration: microseconds
per delta and for the whole text (median of --iters). "plain" is the same text through no
parser, the floor. CPU only (the parsers run on the front-end's event loop).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from nanovllm.entrypoints.tool_parsers import merge_deltas
from nanovllm.entrypoints.tools import ChoiceParser, ParserConfig, ToolPlan


def make_output(calls: int, argument_chars: int) -> str:
    words = ("Paris", "weather", "forecast", "kilometres", "humidity", "wind")
    blocks = []
    for i in range(calls):
        items, size = [], 0
        while size < argument_chars:
            item = {"day": len(items), "note": " ".join(words[(len(items) + k) % len(words)] for k in range(8))}
            items.append(item)
            size += len(json.dumps(item)) + 2
        arguments = json.dumps({"city": "Paris", "items": items})
        blocks.append(f'<tool_call>\n{{"name": "tool_{i}", "arguments": {arguments}}}\n</tool_call>')
    return "<think>The user wants data; I will call the tools.</think>\n\nCalling them now.\n" + "\n".join(blocks)


def median_us(fn, iters: int) -> float:
    times = []
    for _ in range(iters + 1):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--argument-chars", type=int, default=2000)
    ap.add_argument("--delta-chars", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()

    text = make_output(args.calls, args.argument_chars)
    deltas = [text[i:i + args.delta_chars] for i in range(0, len(text), args.delta_chars)]
    configs = {
        "plain": (ToolPlan("none", None), ParserConfig()),
        "hermes": (ToolPlan("auto", []), ParserConfig("hermes", True)),
        "hermes+qwen3": (ToolPlan("auto", []), ParserConfig("hermes", True, "qwen3")),
    }
    rows = {}
    for name, (plan, config) in configs.items():
        def streamed() -> None:
            parser = ChoiceParser(plan, config)
            merge_deltas([parser.feed(d) for d in deltas] + [parser.finish()])

        def whole() -> None:
            parser = ChoiceParser(plan, config)
            merge_deltas([parser.feed(text), parser.finish()])

        parser = ChoiceParser(plan, config)
        parsed = merge_deltas([parser.feed(d) for d in deltas] + [parser.finish()])
        stream_us = median_us(streamed, args.iters)
        rows[name] = {
            "calls_found": len(parsed.tool_calls),
            "streamed_us_per_delta": round(stream_us / len(deltas), 2),
            "streamed_ms_total": round(stream_us / 1e3, 2),
            "whole_ms": round(median_us(whole, args.iters) / 1e3, 3),
        }
    print(json.dumps({"chars": len(text), "deltas": len(deltas), **vars(args), "results": rows}, indent=1))


if __name__ == "__main__":
    main()
