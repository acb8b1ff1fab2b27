"""Where the persistent one-sequence decode kernel's time goes: the per-token kernel times that
docs/persistent_kernel.md reports (graph replay per context, per-stage costs, the grid barrier).

    python benchmarks/persistent_decode.py --model /tmp/q06 [--contexts 640 64 4000] [--breakdown] [--timeline]
        [--compare split_tokens=32,block_t=32 ...] [--barriers]
        [--timeline-variants fused_head=False ...] [--dump /tmp/stamps] [--burst 8] [--sm-streams 400]

Per context: one replay of the batch-1 CUDA graph (the persistent kernel) against one replay of
the per-op graph of 8 rows with only the first row live (what a lone sequence runs without the
persistent kernel: it is padded to 8 rows of length 0).
With --timeline, at the first context: stamps from inside the kernel (a PROBE build), per stage
and inside attention. With --breakdown, at the first context: the persistent kernel with no stage on (its barriers
alone), then with one stage on at a time (each stage's cost per layer), a few tile shapes, a few
attention split shapes, an empty launch, the grid barrier alone (a kernel that only crosses
barriers, one program per SM), and each compiled variant's registers and spills. --barriers
runs only that last grid-barrier comparison. --compare times, at every context, the kernel built
with PersistentDecoder keywords (comma-separated) between two runs of the default one.
--burst K, at the first context: a decode burst of K steps in one launch (multi_step) against K
launches of one step of the per-step build (multi_step=False), per token, and whether both give
the same tokens. --sm-streams N: N launches of a PROBE build; per SM (%smid), the LM head's stream
time, and whether programs keep their SMs from launch to launch.
"""
from __future__ import annotations

import argparse
import ast

import torch
import triton
import triton.language as tl

from nanovllm.fastpath.ptx import grid_arrive, grid_wait


def timed(fn, reps: int = 20) -> float:
    """Mean microseconds per call of fn (CUDA events, after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps * 1e3


@triton.jit
def _empty(x):
    pass


@triton.jit
def _atomic_poll_barrier(sync_ptr, target):
    """The first version's barrier, for comparison: it polls with atomics."""
    tl.debug_barrier()
    tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _volatile_poll_barrier(sync_ptr, target):
    """The second version's, for comparison: polls with volatile loads, which order nothing (its
    closing acquiring atomic, an add of 0 whose result was unused, was dropped by Triton 3.6)."""
    tl.debug_barrier()
    seen = tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu") + 1
    while seen < target:
        seen = tl.load(sync_ptr, volatile=True)
    tl.debug_barrier()


@triton.jit
def _barriers_only(sync_ptr, n, POLL: tl.constexpr):
    """n grid barriers in a row. POLL 0: the counter of grid_arrive, grid_wait with every
    thread taking the arrival's answer (acquire-load polling); 1: atomics; 2: volatile loads;
    3: the kernel's (decoder.ONE_THREAD_BARRIER: thread 0 adds and polls)."""
    num_programs = tl.num_programs(0)
    arrivals = num_programs * 0
    for _ in range(0, n):
        arrivals += num_programs
        if POLL == 1:
            _atomic_poll_barrier(sync_ptr, arrivals)
        elif POLL == 2:
            _volatile_poll_barrier(sync_ptr, arrivals)
        else:
            grid_wait(sync_ptr, grid_arrive(sync_ptr, POLL == 3), arrivals)


def greedy_pick(d, ids, pos, meta):
    """One eager launch of decoder d as a greedy stream's step runs it: with a fused head, the
    token picked (from the int8 head where quantized_head is on) and no logits asked for."""
    if d.fused_head:
        return d(ids, pos, meta, d.greedy_token, d.greedy_temperature, d.no_seed)
    return d(ids, pos, meta)


def timeline(dec, runner, ids, pos, meta, dump: str | None = None, **kwargs) -> None:
    """Run a PROBE build of the kernel (it stamps the global timer and the SM's cycle counter at
    PROBE_POINTS of every layer, runner/persistent_decode.py) and print, per stage, the median over
    layers 2..num_layers-2 of: the work of the median and of the slowest program, the first-tile
    load issued before the barrier, and the barrier (last arrival to the median program's
    leaving); then attention's steps. Intervals within a program come from the cycle counter,
    converted with the ratio of cycles to global nanoseconds over the kernel. dump: also save the
    raw stamps ([2, layers, PROBE_POINTS, programs], numpy) there; kwargs: PersistentDecoder keywords."""
    import numpy as np

    from nanovllm.fastpath import decoder as pd

    d = pd.PersistentDecoder(dec.model, num_programs=dec.num_programs, probe=True, **kwargs)
    d.bind(runner.k_caches, runner.v_caches)
    d2 = pd.PersistentDecoder(dec.model, num_programs=dec.num_programs, probe=True, **kwargs)  # the launch after
    d2.bind(runner.k_caches, runner.v_caches)
    total_us = timed(lambda: greedy_pick(d, ids, pos, meta))
    d.probe.zero_()  # stamps of one call only: which program combines a head's splits varies between calls
    greedy_pick(d, ids, pos, meta)
    greedy_pick(d2, ids, pos, meta)  # queued behind d's launch: when its programs start
    shape = (2, dec.num_layers, pd._PROBE_POINTS, dec.num_programs)
    stamps = d.probe.view(shape).cpu().numpy().astype(np.float64)
    after = d2.probe.view(shape).cpu().numpy().astype(np.float64)
    if dump:
        np.save(dump, stamps)
    stages = [0, 1, 3] if d.fused_attn else [0, 1, 2, 3] if d.fused_mlp else [0, 1, 2, 3, 4]
    print_timeline(stamps, total_us, stages)
    ns, nxt = stamps[0], after[0]
    if (ns[0, 6] > 0).all():  # the program-level stamps (layer 0's points 6, 8 and 12)
        start, layers, last = ns[0, 6], ns[0, 0], 3 * stages[-1] + 1  # (the last stage's work done)
        print(f"  program start -> layer 0's stage A: median {np.median(layers - start) / 1e3:5.2f} us, "
              f"first start to last A start {(layers.max() - start.min()) / 1e3:5.2f}")
        print(f"  the layers: first A start -> last program's last arrival {(ns[-1, last + 1].max() - layers.min()) / 1e3:7.2f} us")
        if d.fused_head:
            head, end = ns[0, 8], ns[0, 12]
            print(f"  last barrier left -> program end (the LM head and pick): median {np.median(end - head) / 1e3:5.2f} us, "
                  f"first leave to last end {(end.max() - head.min()) / 1e3:5.2f}")
            if (ns[0, 7] > 0).all():  # the int8 head's own points: its stream done (7), its candidates done (13)
                streamed, picked = ns[0, 7], ns[0, 13]
                q = lambda a: " / ".join(f"{np.percentile(a, p) / 1e3:5.2f}" for p in (0, 50, 90, 100))  # noqa: E731
                print(f"  int8 head, from the first program's leave (min / median / 90% / max over programs): "
                      f"stream done {q(streamed - head.min())}; candidates done {q(picked - head.min())}; "
                      f"program end {q(end - head.min())}")
                print(f"  int8 head per program: stream {q(streamed - head)}, candidates {q(picked - streamed)}, "
                      f"pick {q(end - picked)}; the last program's pick {(end.max() - picked[end.argmax()]) / 1e3:5.2f}")
        else:
            end = ns[0, 8]
        print(f"  last program end -> next launch's first program start {(nxt[0, 6].min() - end.max()) / 1e3:5.2f} us, "
              f"to its last {(nxt[0, 6].max() - end.max()) / 1e3:5.2f}; the launch's first start to last end "
              f"{(end.max() - start.min()) / 1e3:7.2f} us")


def print_timeline(stamps, total_us: float, stages: list[int] | None = None) -> None:
    """stages: the kernel's stages per layer, [0, 1, 2, 3, 4] (A-E); fused_mlp has no E (D does
    the down projection), fused_attn no C either (B does the o projection)."""
    import numpy as np

    stages = stages or [0, 1, 2, 3, 4]
    ns, cyc = stamps[0], stamps[1]
    num_layers = ns.shape[0]
    reached = ns > 0
    last_done = 3 * stages[-1] + 1
    rate = np.median((cyc[-1, last_done] - cyc[0, 0]) / (ns[-1, last_done] - ns[0, 0]))  # cycles per ns
    us_cyc = lambda a, b: (cyc[:, b] - cyc[:, a]) / rate / 1e3  # noqa: E731  [layers, programs]
    layers = slice(2, num_layers - 2)
    print(f"timeline: {total_us:.1f} us per call with stamps; SM clock {rate:.2f} GHz; per stage, median over layers:")
    names = ["A norm+qkv", "B attention", "C o+residual", "D norm+gate_up+silu", "E down+residual"]
    if 4 not in stages:
        names[3] = "D norm+gate_up+down"
    if 2 not in stages:
        names[1] = "B attention+o"
    for i, stage in enumerate(stages):
        name = names[stage]
        start, done, arrive = 3 * stage, 3 * stage + 1, 3 * stage + 2
        work = us_cyc(start, done)[layers]
        prefetch = us_cyc(done, arrive)[layers]
        if i < len(stages) - 1:
            leave = ns[layers, 3 * stages[i + 1]]
        else:
            leave = ns[3:num_layers - 1, 0]
        barrier = (np.median(leave, axis=1) - ns[layers, arrive].max(axis=1)) / 1e3
        span = (np.median(leave, axis=1) - np.median(ns[layers, start], axis=1)) / 1e3
        landed = ""
        if stage != 1 and reached[layers, 20 + stage].all():
            waited = us_cyc(start, 20 + stage)[layers]
            landed = f"; of the work, waiting for its weights median {np.median(waited):5.2f} / longest {np.median(waited.max(axis=1)):5.2f}"
        print(f"  {name:20s} span {np.median(span):6.2f} us = work median {np.median(work):5.2f} / slowest "
              f"{np.median(work.max(axis=1)):5.2f}, next tile {np.median(prefetch):5.2f}, barrier after the last "
              f"arrival {np.median(barrier):5.2f}{landed}")
    steps = [(3, 15, "stage start -> queries normed + rotated"), (15, 16, "-> cached positions walked"),
             (16, 17, "-> step's token attended + stored (last split)"), (16, 18, "-> split count returned (fused_attn: the o item's KV head done)"),
             (18, 19, "-> splits combined (last to finish)"), (3, 4, "whole attention work")]
    for a, b, what in steps:
        both = reached[:, a] & reached[:, b]
        both[:2] = both[-2:] = False
        vals = ((cyc[:, b] - cyc[:, a]) / rate / 1e3)[both]
        print(f"  attention {what:48s}: median {np.median(vals):5.2f} us, max {vals.max():5.2f} (n={vals.size})")


def burst_in_one_launch(runner, steps: int, ctx: int) -> None:
    """Eager launches at context ctx (its K/V stored as the steps go): one step, `steps` steps in
    one launch of the default decoder (multi_step) and `steps` launches of one step each of the
    per-step build, in us per token, three rounds; then the tokens of both from the same start."""
    import numpy as np

    from nanovllm.fastpath import decoder as pd

    g, multi = runner.fastpath.graphs, runner.fastpath.decoder
    if not multi.multi_step:
        print("burst: the decoder cannot run several steps in one launch (no fused head)")
        return
    if not g.bursts or g.bursts[0].steps < steps:
        print(f"burst: the burst graphs' inputs hold fewer than {steps} records")
        return
    s = g.bursts[0]
    table = list(range(-(-(ctx + steps) // runner.block_size)))
    host = np.zeros(s.nbytes, dtype=np.uint8)
    s.fill_host(host, token=1234, position=ctx - 1, block_table=table, block_size=runner.block_size, steps=steps)
    s.buffer.copy_(torch.from_numpy(host))
    single = pd.PersistentDecoder(multi.model, num_programs=multi.num_programs, multi_step=False)
    single.bind(runner.k_caches, runner.v_caches)
    metas = [s.meta(i) for i in range(steps)]

    def one(d) -> None:
        d(s.tokens[0], s.positions[0], metas[0], s.tokens[0], s.temperatures[0], s.seeds[0])

    def in_one_launch() -> None:
        multi(s.tokens[0], s.positions[0], metas[0], s.tokens[0], s.temperatures[0], s.seeds[0], steps=steps,
              record_bytes=s.RECORD)

    def per_step() -> None:
        for i in range(steps):
            single(s.tokens[i], s.positions[i], metas[i], s.tokens[(i + 1) % steps], s.temperatures[i], s.seeds[i])

    for _ in range(3):
        print(f"burst at context {ctx}: one step {timed(lambda: one(multi)):.1f} us (per-step build "
              f"{timed(lambda: one(single)):.1f}); {steps} steps per token: in one launch "
              f"{timed(in_one_launch) / steps:.1f} us, a launch per step {timed(per_step) / steps:.1f} us")
    tokens = []
    for run in (in_one_launch, per_step):
        s.tokens[0].fill_(1234)
        run()
        ids = s.records[:steps, 0].tolist()
        tokens.append(ids[1:] + ids[:1])
    print(f"burst tokens {'equal' if tokens[0] == tokens[1] else 'DIFFER'}: {tokens[0]}")


def sm_streams(dec, runner, ids, pos, meta, launches: int) -> None:
    """`launches` eager launches of a PROBE build (it also records each program's SM): whether the
    programs keep their SMs, and each SM's LM-head stream time (the head's start to its last
    chunk multiplied), with the correlation of its means over even and odd launches (how much of
    the spread between programs is the SM's own)."""
    import numpy as np

    from nanovllm.fastpath import decoder as pd

    d = pd.PersistentDecoder(dec.model, num_programs=dec.num_programs, probe=True)
    d.bind(runner.k_caches, runner.v_caches)
    if not d.quantized_head:
        print("sm-streams: needs the int8 head's stamps (quantized_head)")
        return
    for _ in range(3):
        greedy_pick(d, ids, pos, meta)
    n = dec.num_programs
    view = d.probe.view(2, dec.num_layers, pd._PROBE_POINTS, n)
    hist = torch.empty((launches, pd._PROBE_POINTS, n), dtype=torch.int64, device="cuda")
    for i in range(launches):
        greedy_pick(d, ids, pos, meta)
        hist[i].copy_(view[0, 0])  # layer 0's global-time stamps (and point 14, the SM)
    h = hist.cpu().numpy()
    sm, head, streamed = h[:, 14, :], h[:, 8, :].astype(np.float64), h[:, 7, :].astype(np.float64)
    mappings = {tuple(row) for row in sm}
    stream = (streamed - head) / 1e3
    per_sm = np.full((launches, int(sm.max()) + 1), np.nan)
    for i in range(launches):
        per_sm[i, sm[i]] = stream[i]
    mean = np.nanmean(per_sm, axis=0)
    even, odd = np.nanmean(per_sm[0::2], axis=0), np.nanmean(per_sm[1::2], axis=0)
    ok = ~np.isnan(even) & ~np.isnan(odd)
    print(f"sm-streams: {launches} launches, {len(mappings)} program->SM mapping(s); LM-head stream per program "
          f"median {np.median(stream):.2f} us, spread within a launch (max - min) median "
          f"{np.median(stream.max(1) - stream.min(1)):.2f}; per-SM means {np.nanmin(mean):.2f}-{np.nanmax(mean):.2f} us, "
          f"even/odd launches' means correlate {np.corrcoef(even[ok], odd[ok])[0, 1]:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--contexts", type=int, nargs="+", default=[640])
    ap.add_argument("--breakdown", action="store_true", help="also time each stage, the barrier and tile shapes (at the first context)")
    ap.add_argument("--timeline", action="store_true", help="also stamp times inside the kernel (a PROBE build, at the first context)")
    ap.add_argument("--compare", nargs="+", metavar="KEY=VALUE[,KEY=VALUE]", default=[],
                    help="also time the kernel built with these PersistentDecoder keywords (e.g. split_tokens=32,block_t=32) "
                         "between two runs of the default one, at every context")
    ap.add_argument("--barriers", action="store_true", help="also time the grid barrier variants alone")
    ap.add_argument("--timeline-variants", nargs="+", metavar="KEY=VALUE[,KEY=VALUE]", default=[],
                    help="with --timeline: also the timeline of the kernel built with these keywords")
    ap.add_argument("--burst", type=int, default=0, metavar="K",
                    help="also time a burst of K steps in one launch against K launches (at the first context)")
    ap.add_argument("--sm-streams", type=int, default=0, metavar="N",
                    help="also run N launches of a PROBE build and print the LM head's stream time per SM")
    ap.add_argument("--dump", metavar="PREFIX", help="with --timeline: save each timeline's raw stamps to PREFIX<n>.npy "
                    "(0 the default kernel, then the variants in order)")
    args = ap.parse_args()
    from nanovllm import LLM
    from nanovllm.fastpath import decoder as pd

    llm = LLM(args.model, max_model_len=max(4096, max(args.contexts)))
    runner = llm.engine.executor.runner
    runner.finish_background_compile()
    g, lone, dec = runner.graph_runner, runner.fastpath.graphs, runner.fastpath.decoder

    def set_context(ctx: int) -> None:
        blocks = -(-ctx // runner.block_size)
        table = torch.arange(blocks, dtype=torch.int32, device="cuda")
        g.seq_lens.zero_()  # rows 1-7 of the 8-row graph are padding (length 0)
        g.slot_mapping.fill_(-1)  # nothing stored
        g.seq_lens[0] = ctx
        g.positions[0] = ctx - 1
        g.block_tables[0, :blocks] = table
        s = lone.single  # the persistent graph's inputs
        s.slot.fill_(-1)
        s.seq_len.fill_(ctx)
        s.position.fill_(ctx - 1)
        s.block_table[0, :blocks] = table

    head = runner.model.compute_logits
    logits_us = timed(lambda: head(g.outputs[8][:1]))
    for ctx in args.contexts:
        set_context(ctx)
        # The persistent graph also holds the LM head and the argmax: its forward alone is the
        # replay less the LM head's eager time (timed here on one row).
        single = timed(lone.single_graph.replay)
        print(f"context {ctx:5d}: persistent graph (batch 1) {single:8.1f} us with LM head and argmax, "
              f"~{single - logits_us:6.1f} without (LM head alone {logits_us:.1f}); "
              f"per-op graph (8 rows, one live) {timed(g.graphs[8].replay):8.1f} us")
    meta = lone.single.meta()
    ids, pos = lone.single.token, lone.single.position
    sms = dec.num_programs
    decoders: dict[str, pd.PersistentDecoder] = {}
    seen: set[int] = set()

    def registers() -> str:
        """Registers and spills of the variants compiled since the last call."""
        out = []
        for caches in pd._decode_kernel.device_caches.values():
            for k in caches[0].values():
                if id(k) not in seen:
                    seen.add(id(k))
                    out.append(f"regs {k.n_regs} spills {k.n_spills}")
        return "; ".join(out)

    def decoder(spec: str = "", **kwargs) -> pd.PersistentDecoder:
        """The kernel built with these keywords (compiled and bound once per spec)."""
        key = spec or repr(sorted(kwargs.items()))
        if key not in decoders:
            decoders[key] = pd.PersistentDecoder(dec.model, num_programs=sms, **kwargs)
            decoders[key].bind(runner.k_caches, runner.v_caches)
        return decoders[key]

    def persistent(spec: str = "", **kwargs) -> float:
        """Microseconds per eager launch of decoder(spec, **kwargs), a greedy step's (greedy_pick)."""
        d = decoder(spec, **kwargs)
        return timed(lambda: greedy_pick(d, ids, pos, meta))

    for spec in args.compare:
        kwargs = keywords(spec)
        for ctx in args.contexts:
            set_context(ctx)
            before, variant, after = persistent(), persistent(spec, **kwargs), persistent()
            mine = greedy_pick(decoder(), ids, pos, meta).clone()
            theirs = greedy_pick(decoder(spec, **kwargs), ids, pos, meta).clone()
            diff = (mine.float() - theirs.float()).abs().max().item()
            print(f"context {ctx:5d}: persistent (eager launch), defaults {before:8.1f} / {after:8.1f} us, "
                  f"{spec}: {variant:8.1f} us, hidden state "
                  f"{'identical' if diff == 0 else f'differs by at most {diff:.3g}'}  [{registers()}]")
    set_context(args.contexts[0])  # the breakdown and the timeline run at the first context
    if args.timeline:
        for n, spec in enumerate([""] + args.timeline_variants):
            if spec:
                print(f"timeline of {spec}:")
            timeline(dec, runner, ids, pos, meta, f"{args.dump}{n}.npy" if args.dump else None, **keywords(spec))
    if args.sm_streams:
        sm_streams(dec, runner, ids, pos, meta, args.sm_streams)
    if args.burst:
        burst_in_one_launch(runner, args.burst, args.contexts[0])
        set_context(args.contexts[0])  # (the burst stored K/V and left its records)
    if args.breakdown:
        breakdown(persistent, registers, dec.num_layers)
    if args.breakdown or args.barriers:
        barriers(sms)


def keywords(spec: str) -> dict:
    """PersistentDecoder keywords from "key=value,key=value" (values are Python literals)."""
    kwargs = {}
    for pair in filter(None, spec.split(",")):
        key, value = pair.split("=", 1)
        kwargs[key] = ast.literal_eval(value)
    return kwargs


def breakdown(persistent, registers, num_layers: int) -> None:
    """The kernel with no stage on (its barriers alone), with one stage on at a time, and a few
    tile and split shapes (eager launches), with each build's registers and spills."""
    base = persistent(stage_mask=0)
    print(f"persistent, barriers only (no stage runs): {base:8.1f} us  [{registers()}]")
    names = ["A norm+qkv", "B attention", "C o+residual", "D norm+gate_up+silu", "E down+residual"]
    for stage, name in enumerate(names):
        us = persistent(stage_mask=1 << stage)
        print(f"stage {name:22s}: {(us - base) / num_layers:7.2f} us per layer  [{registers()}]")
    variants = [
        dict(),
        dict(tile_elements=16384),
        dict(split_tokens=32, block_t=32),
        dict(split_tokens=32, block_t=64),
        dict(tile_elements=16384, split_tokens=32, block_t=64),
    ]
    for kwargs in variants:
        us = persistent(**kwargs)
        print(f"persistent, all stages, {kwargs or 'defaults'}: {us:8.1f} us  [{registers()}]")


def barriers(sms: int) -> None:
    """An empty launch and the grid barrier variants alone, one program per SM."""
    buf = torch.zeros(1, dtype=torch.int32, device="cuda")
    print(f"empty launch, {sms} programs: {timed(lambda: _empty[(sms,)](buf)):6.2f} us")
    n = 1000
    variants = ((0, "counter, acquire-load polling"), (1, "counter, atomic polling"),
                (2, "counter, volatile-load polling"), (3, "counter, thread 0 adds and polls (the kernel's)"))
    for poll, name in variants:
        us = timed(lambda: (buf.zero_(), _barriers_only[(sms,)](buf, n, POLL=poll))) / n
        print(f"grid barrier, {sms} programs, {name}: {us:6.3f} us each")


if __name__ == "__main__":
    main()
