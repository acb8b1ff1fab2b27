"""Triton attention kernels on the GPU: parity with the torch reference, then timings.

Run from the repository root on the H200:

    python3 benchmarks/attention_kernels.py [--sweep | --splits] [--out DIR]

1. Parity at the Qwen3-0.6B attention shape (16 q heads, 8 kv heads, head_dim 128, bf16) for
   several batch mixes and block sizes 16 and 32 (max abs error vs the torch backend).
2. Decode timings: batch 256 with contexts drawn from [1024, 2048], batch 1 with a 4096 context
   (and batches 64 and 16, and a short batch-1 context, to tune the split heuristic), single-pass
   vs split-KV with several split counts; "(auto)" marks what the backend picks. Each is timed
   with triton.testing.do_bench (median; includes the Python launch cost) and with
   do_bench_cudagraph (median; what a CUDA-graph decode step pays). The KV bytes read (sum of
   context lengths x 8 heads x 128 x 2 (K,V) x 2 bytes) over the graph time gives GB/s against the
   ~4.3 TB/s copy rate measured on this GPU.
3. Prefill timing (causal, fresh prompts and a chunk after a prefix) vs torch's SDPA (flash) on the
   same shapes, in TFLOP/s; store_kv timing.
4. --sweep: tile shapes / warps / stages for the decode and prefill kernels; prints the best.
5. --splits (alone): decode batches shaped like W1's (the batch shrinks as contexts grow) at
   1-32 splits and a few tiles, in CUDA graphs; what the split heuristic was chosen from.
6. --order (alone): the same batches in arrival order vs longest context first.
The short table is printed last; with --out the full results are also written as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.testing  # noqa: E402

from nanovllm.attention.metadata import AttentionMetadata  # noqa: E402
from nanovllm.attention.kernels.paged_attention import TileConfig  # noqa: E402
from nanovllm.attention.kernels.store_kv import store_kv  # noqa: E402
from nanovllm.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from nanovllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
SCALE = HEAD_DIM**-0.5
PEAK_GBS = 4300.0  # device-to-device copy, bytes read + written, measured on this H200
DTYPE = torch.bfloat16
DEVICE = torch.device("cuda")


def build(decode_ctx: list[int], prefills: list[tuple[int, int]], block_size: int, seed: int = 0) -> dict:
    """A step's tensors: decodes first, then (prefix, chunk) prefills; blocks scattered at random."""
    gen = torch.Generator().manual_seed(seed)
    ctx = list(decode_ctx) + [p + c for p, c in prefills]
    qlens = [1] * len(decode_ctx) + [c for _, c in prefills]
    nblocks = [-(-c // block_size) for c in ctx]
    num_blocks = sum(nblocks) + 8
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.zeros(len(ctx), max(nblocks), dtype=torch.int32)
    start = 0
    for i, n in enumerate(nblocks):
        tables[i, :n] = perm[start : start + n]
        start += n
    qlens_t, ctx_t = torch.tensor(qlens), torch.tensor(ctx)
    seq_of_token = torch.repeat_interleave(torch.arange(len(ctx)), qlens_t)
    qsl = torch.zeros(len(ctx) + 1, dtype=torch.int32)
    qsl[1:] = qlens_t.cumsum(0)
    pos = (ctx_t - qlens_t)[seq_of_token] + torch.arange(sum(qlens)) - qsl[:-1].long()[seq_of_token]
    slots = tables[seq_of_token, pos // block_size].long() * block_size + pos % block_size
    dev = DEVICE
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    t = sum(qlens)
    meta = AttentionMetadata(
        slot_mapping=slots.to(dev),
        query_start_loc=qsl.to(dev),
        seq_lens=ctx_t.to(torch.int32).to(dev),
        block_tables=tables.to(dev),
        num_decodes=len(decode_ctx),
        max_query_len=max(qlens),
        max_seq_len=max(ctx),
        query_lens_cpu=qlens,
        seq_lens_cpu=ctx,
    )
    return dict(
        q=torch.randn(t, NUM_HEADS, HEAD_DIM, device=dev, dtype=DTYPE),
        k=torch.randn(t, NUM_KV_HEADS, HEAD_DIM, device=dev, dtype=DTYPE),
        v=torch.randn(t, NUM_KV_HEADS, HEAD_DIM, device=dev, dtype=DTYPE),
        k_cache=torch.randn(shape, device=dev, dtype=DTYPE),
        v_cache=torch.randn(shape, device=dev, dtype=DTYPE),
        meta=meta,
    )


def kv_bytes(meta: AttentionMetadata) -> int:
    return sum(meta.seq_lens_cpu) * NUM_KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize


def causal_flops(meta: AttentionMetadata) -> float:
    """QK^T and PV flops actually needed (each query token sees its prefix + itself)."""
    total = 0
    for qlen, ctx in zip(meta.query_lens_cpu, meta.seq_lens_cpu):
        prefix = ctx - qlen
        total += qlen * prefix + qlen * (qlen + 1) // 2
    return 4.0 * NUM_HEADS * HEAD_DIM * total


def median_ms(fn, graph: bool) -> float:
    fn()
    torch.cuda.synchronize()
    if graph:
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
        except TypeError:
            return triton.testing.do_bench_cudagraph(fn, rep=100, quantiles=[0.5])
    try:
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    except TypeError:
        return triton.testing.do_bench(fn, warmup=25, rep=200, quantiles=[0.5])


def parity(results: dict) -> list[tuple[str, float, bool]]:
    def lengths(n: int, high: int, seed: int) -> list[int]:
        return [int(x) for x in torch.randint(1, high, (n,), generator=torch.Generator().manual_seed(seed))]

    cases = {
        "decode 64 x 1-2k": (lengths(64, 2048, 1), []),
        "decode 4 x 4k (split)": ([4096, 4000, 3001, 17], []),
        "prefill 2 x 1k fresh + chunk after 1.5k prefix": ([], [(0, 1024), (0, 700), (1531, 512)]),
        "mixed 32 decodes + 2 chunks": (lengths(32, 3000, 2), [(0, 333), (777, 256)]),
    }
    rows = []
    for block_size in (16, 32):
        for name, (dec, pre) in cases.items():
            b = build(dec, pre, block_size, seed=block_size)
            ref = TorchAttentionBackend().forward(
                b["q"], b["k"], b["v"], b["k_cache"].clone(), b["v_cache"].clone(), b["meta"], SCALE
            )
            for split in ((None, False, True) if not pre else (None,)):
                out = TritonAttentionBackend(split_kv=split).forward(
                    b["q"], b["k"], b["v"], b["k_cache"].clone(), b["v_cache"].clone(), b["meta"], SCALE
                )
                err = (out.float() - ref.float()).abs().max().item()
                ok = bool(torch.isfinite(out).all()) and err < 3e-2
                label = f"bs{block_size} {name}" + ("" if split is None else f" split={split}")
                rows.append((label, err, ok))
    results["parity"] = rows
    return rows


def time_decode(results: dict) -> list[dict]:
    """Decode attention at several batch sizes, each with a few split counts (1 = single pass)."""
    gen = torch.Generator().manual_seed(0)
    cases = {  # name: (context lengths, split counts to try)
        "decode b256 ctx 1-2k": ([int(x) for x in torch.randint(1024, 2049, (256,), generator=gen)], (1, 2)),
        "decode b64 ctx 2k": ([2048] * 64, (1, 2, 4)),
        "decode b16 ctx 4k": ([4096] * 16, (1, 2, 4, 8)),
        "decode b1 ctx 4k": ([4096], (1, 4, 8, 16, 32)),
        "decode b1 ctx 512": ([512], (1, 8, 32)),
    }
    rows = []
    for name, (ctx, split_counts) in cases.items():
        b = build(ctx, [], block_size=16)
        meta = b["meta"]
        out = torch.empty_like(b["q"])
        nbytes = kv_bytes(meta)
        auto = TritonAttentionBackend().decode_num_splits(len(ctx), NUM_KV_HEADS, b["q"].device)
        for splits in sorted(set(split_counts) | {auto}):
            be = TritonAttentionBackend(split_kv=splits > 1, num_splits=splits if splits > 1 else None)
            label = "single-pass" if splits == 1 else f"split-KV {splits}"
            label += " (auto)" if splits == auto else ""
            fn = lambda be=be: be.attend(b["q"], b["k_cache"], b["v_cache"], meta, SCALE, out)  # noqa: E731
            ms = median_ms(fn, graph=False)
            ms_graph = median_ms(fn, graph=True)
            rows.append(dict(case=name, variant=label, ms=ms, us_graph=ms_graph * 1e3,
                             gbs=nbytes / (ms_graph * 1e-3) / 1e9, kv_mb=nbytes / 1e6))
        if name.startswith("decode b256"):  # the reference, for scale (it includes store_kv)
            torch_be = TorchAttentionBackend()
            fn = lambda: torch_be.forward(b["q"], b["k"], b["v"], b["k_cache"], b["v_cache"], meta, SCALE)  # noqa: E731
            ms = median_ms(fn, graph=False)
            rows.append(dict(case=name, variant="torch backend (do_bench)", ms=ms, us_graph=float("nan"),
                             gbs=nbytes / (ms * 1e-3) / 1e9, kv_mb=nbytes / 1e6))
    results["decode"] = rows
    return rows


def time_prefill(results: dict) -> list[dict]:
    import torch.nn.functional as F

    cases = {
        "prefill 4 x 2048 fresh": [(0, 2048)] * 4,
        "prefill chunk 2048 after 6k prefix": [(6144, 2048)],
    }
    rows = []
    for name, pre in cases.items():
        b = build([], pre, block_size=16)
        meta = b["meta"]
        out = torch.empty_like(b["q"])
        flops = causal_flops(meta)
        be = TritonAttentionBackend()
        fn = lambda: be.attend(b["q"], b["k_cache"], b["v_cache"], meta, SCALE, out)  # noqa: E731
        ms = median_ms(fn, graph=False)
        rows.append(dict(case=name, variant="triton paged", ms=ms, tflops=flops / (ms * 1e-3) / 1e12))
        if all(p == 0 for p, _ in pre):  # peer: torch SDPA on contiguous q/k/v, same causal work
            qlen = pre[0][1]
            q = torch.randn(len(pre), NUM_HEADS, qlen, HEAD_DIM, device=DEVICE, dtype=DTYPE)
            k = torch.randn(len(pre), NUM_HEADS, qlen, HEAD_DIM, device=DEVICE, dtype=DTYPE)
            v = torch.randn_like(k)
            sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE)  # noqa: E731
            ms = median_ms(sdpa, graph=False)
            rows.append(dict(case=name, variant="torch SDPA (contiguous, MHA)", ms=ms, tflops=flops / (ms * 1e-3) / 1e12))
    results["prefill"] = rows
    return rows


def time_store(results: dict) -> list[dict]:
    rows = []
    for n in (256, 8192):
        b = build([], [(0, n)], block_size=16)
        fn = lambda: store_kv(b["k"], b["v"], b["k_cache"], b["v_cache"], b["meta"].slot_mapping)  # noqa: E731
        ms = median_ms(fn, graph=True)
        moved = 2 * 2 * n * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize  # read + write, K and V
        rows.append(dict(case=f"store_kv {n} tokens", us_graph=ms * 1e3, gbs=moved / (ms * 1e-3) / 1e9))
    results["store_kv"] = rows
    return rows


def split_sweep(results: dict) -> list[dict]:
    """Decode batches as W1 meets them (the batch shrinks as short requests finish, so small
    batches have long contexts): each batch size with 1..16 splits and a few tile shapes, timed
    in CUDA graphs. Picks the split heuristic and the decode tile."""
    gen = torch.Generator().manual_seed(1)
    cases = {256: (100, 1100), 192: (300, 1400), 128: (600, 1700), 64: (1100, 1900), 32: (1400, 2000),
             16: (1600, 2048), 4: (1800, 2048), 1: (300, 700)}
    tiles = [TileConfig(16, bn, w, st) for bn, w, st in ((64, 4, 2), (32, 4, 2), (64, 4, 3), (128, 4, 2), (64, 8, 2))]
    rows = []
    for bs, (lo, hi) in cases.items():
        ctx = [int(x) for x in torch.randint(lo, hi + 1, (bs,), generator=gen)]
        b = build(ctx, [], block_size=16)
        out = torch.empty_like(b["q"])
        nbytes = kv_bytes(b["meta"])
        auto = TritonAttentionBackend().decode_num_splits(bs, NUM_KV_HEADS, b["q"].device)
        for splits in (1, 2, 4, 8, 16, 32):
            if bs * NUM_KV_HEADS * splits > 16384:
                continue
            for cfg in tiles if splits in (1, auto) else tiles[:1]:
                be = TritonAttentionBackend(split_kv=splits > 1, num_splits=splits if splits > 1 else None, decode_config=cfg)
                fn = lambda be=be: be.attend(b["q"], b["k_cache"], b["v_cache"], b["meta"], SCALE, out)  # noqa: E731
                try:
                    us = median_ms(fn, graph=True) * 1e3
                except Exception as exc:  # noqa: BLE001 - out-of-resources configs are expected
                    print(f"  b{bs} split {splits} {cfg}: {type(exc).__name__}")
                    continue
                rows.append(dict(bs=bs, ctx=f"{lo}-{hi}", splits=splits, auto=splits == auto, tile=str(cfg), us=us,
                                 pct=100 * nbytes / (us * 1e-6) / 1e9 / PEAK_GBS))
    results["split_sweep"] = rows
    return rows


def order_sweep(results: dict) -> list[dict]:
    """W1-shaped decode batches in the order requests arrived (random lengths) vs longest context
    first (the scheduler's order), single-pass with 64- and 128-row KV tiles and the split kernel
    where the backend would pick it. Programs are dispatched roughly in grid order, so the order
    decides which programs are left running alone at the end of a launch."""
    from nanovllm.attention.kernels.paged_attention import paged_attention

    gen = torch.Generator().manual_seed(1)
    cases = {256: (100, 1100), 192: (300, 1400), 128: (600, 1700), 64: (1100, 1900), 48: (1300, 2000),
             32: (1400, 2000), 16: (1600, 2048)}
    rows = []
    for bs, (lo, hi) in cases.items():
        ctx = [int(x) for x in torch.randint(lo, hi + 1, (bs,), generator=gen)]
        for order in ("random", "longest first"):
            b = build(sorted(ctx, reverse=True) if order != "random" else ctx, [], block_size=16)
            out = torch.empty_like(b["q"])
            nbytes = kv_bytes(b["meta"])
            m = b["meta"]
            auto = TritonAttentionBackend().decode_num_splits(bs, NUM_KV_HEADS, b["q"].device)
            variants = []
            for bn in (64, 128):
                cfg = TileConfig(16, bn, 4, 2)
                fn = lambda cfg=cfg: paged_attention(  # noqa: E731
                    b["q"], b["k_cache"], b["v_cache"], out, m.block_tables, m.seq_lens, m.query_start_loc,
                    bs, SCALE, cfg, decode_only=True)
                variants.append((f"single pass, n{bn}", fn))
            if auto > 1:
                be = TritonAttentionBackend()
                variants.append((f"split {auto}", lambda be=be: be.attend(b["q"], b["k_cache"], b["v_cache"], m, SCALE, out)))
            for label, fn in variants:
                us = median_ms(fn, graph=True) * 1e3
                rows.append(dict(bs=bs, ctx=f"{lo}-{hi}", order=order, kernel=label, us=us,
                                 pct=100 * nbytes / (us * 1e-6) / 1e9 / PEAK_GBS))
                print(f"  {bs:5d} {lo:>5d}-{hi:<5d} {order:>13s} {label:>18s} {us:8.1f} us {rows[-1]['pct']:5.0f}%", flush=True)
    results["order_sweep"] = rows
    return rows


def sweep(results: dict) -> dict:
    """Try tile shapes; report the fastest per case (failures to compile are skipped)."""
    best = {}
    gen = torch.Generator().manual_seed(0)
    dec = build([int(x) for x in torch.randint(1024, 2049, (256,), generator=gen)], [], block_size=16)
    one = build([4096], [], block_size=16)
    pre = build([], [(0, 2048)] * 4, block_size=16)
    trials = []
    for bn in (32, 64, 128):
        for warps in (2, 4, 8):
            for stages in (2, 3):
                cfg = TileConfig(16, bn, warps, stages)
                trials.append(("decode b256", dec, TritonAttentionBackend(split_kv=False, decode_config=cfg), cfg))
                trials.append(("decode b1 4k split", one, TritonAttentionBackend(decode_config=cfg), cfg))
    for bm in (64, 128):
        for bn in (32, 64):
            for warps in (4, 8):
                for stages in (2, 3):
                    cfg = TileConfig(bm, bn, warps, stages)
                    trials.append(("prefill 4x2048", pre, TritonAttentionBackend(prefill_config=cfg), cfg))
    log = []
    for case, b, be, cfg in trials:
        out = torch.empty_like(b["q"])
        fn = lambda: be.attend(b["q"], b["k_cache"], b["v_cache"], b["meta"], SCALE, out)  # noqa: E731
        try:
            ms = median_ms(fn, graph=case.startswith("decode"))
        except Exception as exc:  # noqa: BLE001 - out-of-resources configs are expected
            log.append((case, str(cfg), f"failed: {type(exc).__name__}"))
            continue
        log.append((case, str(cfg), ms))
        if case not in best or ms < best[case][1]:
            best[case] = (str(cfg), ms)
    results["sweep"] = log
    results["sweep_best"] = best
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also sweep tile configs")
    parser.add_argument("--splits", action="store_true", help="only the W1-shaped split / tile sweep")
    parser.add_argument("--order", action="store_true", help="only the W1-shaped batch-order / grid-order sweep")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="directory for the JSON results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    props = torch.cuda.get_device_properties(0)
    results: dict = dict(
        device=props.name, sms=props.multi_processor_count, torch=torch.__version__, triton=triton.__version__,
        date=time.strftime("%Y-%m-%d %H:%M"),
    )
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")

    if args.order:
        order_sweep(results)
        return
    if args.splits:
        rows = split_sweep(results)
        print(f"  {'batch':>5s} {'ctx':>10s} {'splits':>6s} {'us':>8s} {'% 4.3TB/s':>9s}  tile")
        for r in rows:
            print(f"  {r['bs']:5d} {r['ctx']:>10s} {r['splits']:6d}{'*' if r['auto'] else ' '} {r['us']:8.1f} {r['pct']:8.0f}%  {r['tile']}")
        return
    t0 = time.time()
    par = parity(results)
    print(f"parity done in {time.time() - t0:.0f}s")
    dec = time_decode(results)
    pre = time_prefill(results)
    sto = time_store(results)
    best = sweep(results) if args.sweep else {}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "attention_kernels.json").write_text(json.dumps(results, indent=1, default=str))

    print("\n== parity vs torch backend (bf16, max abs error) ==")
    for label, err, ok in par:
        print(f"  {'ok ' if ok else 'BAD'} {err:.2e}  {label}")
    print("\n== decode attention (store excluded) ==")
    print(f"  {'case':24s} {'variant':28s} {'do_bench ms':>11s} {'graph us':>9s} {'KV MB':>7s} {'GB/s':>7s} "
          f"{'% of 4.3TB/s':>12s}")
    for r in dec:
        print(f"  {r['case']:24s} {r['variant']:28s} {r['ms']:11.4f} {r['us_graph']:9.1f} {r['kv_mb']:7.1f} "
              f"{r['gbs']:7.0f} {100 * r['gbs'] / PEAK_GBS:11.0f}%")
    print("\n== prefill attention ==")
    for r in pre:
        print(f"  {r['case']:36s} {r['variant']:30s} {r['ms']:8.3f} ms {r['tflops']:6.0f} TFLOP/s")
    for r in sto:
        print(f"  {r['case']:36s} {'graph':30s} {r['us_graph']:8.1f} us {r['gbs']:6.0f} GB/s")
    if best:
        print("\n== sweep: best config per case ==")
        for case, (cfg, ms) in best.items():
            print(f"  {case:24s} {ms * 1e3:9.1f} us  {cfg}")
    if not all(ok for _, _, ok in par):
        sys.exit("parity FAILED")


if __name__ == "__main__":
    main()
