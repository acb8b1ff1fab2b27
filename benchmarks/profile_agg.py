"""Aggregate py-spy's raw samples (one `frame;frame;... count` line per stack) of the engine
core: the share of the loop thread's samples (stacks through EngineCore.run) spent in each
function itself and in each function with what it calls (benchmarks/profile_core.sh).

    python benchmarks/profile_agg.py SAMPLES [--top 40]
"""
from __future__ import annotations

import argparse
import collections


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("samples")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    own, inclusive = collections.Counter(), collections.Counter()
    total = loop = 0
    with open(args.samples) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if not stack:
                continue
            n = int(count)
            total += n
            frames = stack.split(";")
            if not any(frame.startswith("EngineCore.run ") for frame in frames):
                continue
            loop += n
            own[frames[-1]] += n
            for frame in set(frames):
                inclusive[frame] += n
    print(f"samples: {total}, of which {loop} in the core's loop thread ({100 * loop / max(total, 1):.0f}%)")
    for title, counter in (("self", own), ("inclusive", inclusive)):
        print(f"--- {title}")
        for frame, n in counter.most_common(args.top):
            print(f"{100 * n / max(loop, 1):5.1f}%  {frame}")


if __name__ == "__main__":
    main()
