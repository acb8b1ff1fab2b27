"""What does it cost to sum one vector from every SM with atomics, against a grid barrier? (H200)

    python benchmarks/reduce_latency.py

Why: the persistent decode kernel (runner/persistent_decode.py) splits the down projection by
rows, so the MLP needs two grid barriers: one after gate/up (every program needs the whole
activation) and one after down. Split by K instead, each program multiplies its own slice of the
activation by the matching columns and adds a whole [hidden] partial sum into an accumulator with
atomics: one barrier less per layer, at the price of 132 x hidden atomic adds landing on a few
KB of L2. This times, per round over 2,000 dependent rounds, one program per SM (hidden 1,024):
- "rows": each program stores its rows, grid barrier, every program reads the vector (the
  kernel's stage boundary now);
- "red f32" (scalar), "red v4 f32" (16-byte vector reductions, sm_90), "red u64" (fixed point:
  integer sums do not depend on the order, so the result is deterministic): each program adds a
  whole [hidden] partial, grid barrier, every program reads the sum;
each with the accumulator in 1 or 4 copies (program p adds into copy p % copies; readers sum the
copies), which spreads the same adds over more L2 lines;
- "bulk reduce f32": each program stages its partial in shared memory and thread 0 adds all of
  it with one cp.reduce.async.bulk (the TMA unit), waits for it, then arrives.
Each line also prints the programs' result after the last round (the same sum, to rounding, in
every mode but "rows").
"""
import torch
import triton
import triton.language as tl

from nanovllm.runner.ptx import grid_arrive, grid_wait, reserve_shared_memory, shared_address, stage_f32_to_shared
from persistent_decode import timed  # benchmarks/ is the script's directory, first on sys.path


@triton.jit
def _red_v4_f32(ptr, a, b, c, d):
    return tl.inline_asm_elementwise(
        "red.relaxed.gpu.global.add.v4.f32 [$1], {$2, $3, $4, $5}; mov.u32 $0, 0;",
        "=r,l,f,f,f,f", [ptr.to(tl.int64), a, b, c, d], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _red_u64(ptr, v):
    return tl.inline_asm_elementwise("red.relaxed.gpu.global.add.u64 [$1], $2; mov.u32 $0, 0;",
                                     "=r,l,l", [ptr.to(tl.int64), v], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _bulk_reduce_f32(dst_ptr, src, nbytes):
    """Thread 0: add nbytes of fp32 at shared `src` into global dst with one bulk reduction (the
    TMA unit), then wait until it is done and fence the async proxy's writes before the caller's
    release."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p fence.proxy.async.shared::cta; "
        "@p cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$1], [$2], $3; "
        "@p cp.async.bulk.commit_group; @p cp.async.bulk.wait_group 0; @p fence.proxy.async.global; "
        "mov.u32 $0, 0; }",
        "=r,l,r,r", [dst_ptr.to(tl.int64), src, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=("smem_off",))
def _chain(acc_ptr, vec_ptr, sync_ptr, out_ptr, rounds, smem_off, N: tl.constexpr, ROWS: tl.constexpr,
           MODE: tl.constexpr, COPIES: tl.constexpr):
    """MODE 0 rows, 1 red f32, 2 red v4 f32, 3 red u64, 4 one bulk reduction (see the module
    docstring)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    s = 0.0
    offs = tl.arange(0, N)
    rows = pid * ROWS + tl.arange(0, ROWS)
    target = 0
    for r in range(rounds):
        if MODE == 0:
            buf = vec_ptr + (r % 2) * N
            tl.store(buf + rows, (s + rows).to(tl.bfloat16), mask=rows < N)
        else:
            part = s + offs.to(tl.float32) * 1e-3  # this program's [N] partial sum
            acc = acc_ptr + ((r % 3) * COPIES + pid % COPIES) * N
            if MODE == 1:
                tl.atomic_add(acc + offs, part, sem="relaxed", scope="gpu")
            elif MODE == 4:
                buf = shared_address(smem_off)
                stage_f32_to_shared(part, offs, offs < N, buf)
                tl.debug_barrier()
                _bulk_reduce_f32(acc, buf, N * 4)
            elif MODE == 2:
                q = tl.reshape(part, [N // 4, 4])
                a, b = tl.split(tl.reshape(q, [N // 4, 2, 2]))
                a0, a1 = tl.split(a)
                b0, b1 = tl.split(b)
                _red_v4_f32(acc + tl.arange(0, N // 4) * 4, a0, b0, a1, b1)
            else:
                _red_u64(acc + offs, (part * 4294967296.0).to(tl.int64))
        seen = grid_arrive(sync_ptr, True)
        target += P
        grid_wait(sync_ptr, seen, target)
        if MODE == 0:
            x = tl.load(vec_ptr + (r % 2) * N + offs).to(tl.float32)
        else:
            x = tl.zeros([N], tl.float32)
            for c in tl.static_range(COPIES):
                src = acc_ptr + ((r % 3) * COPIES + c) * N + offs
                if MODE == 3:
                    x += tl.load(src).to(tl.float32) * (1.0 / 4294967296.0)
                else:
                    x += tl.load(src)
            # zero this program's rows of the buffer read last round: it is added into two rounds on
            old = acc_ptr + ((r + 2) % 3) * COPIES * N
            for c in tl.static_range(COPIES):
                tl.store(old + c * N + rows, tl.zeros([ROWS], acc_ptr.dtype.element_ty), mask=rows < N)
        s = tl.sum(x) * 1e-9
    tl.store(out_ptr + pid, s)


def main() -> None:
    dev = torch.device("cuda")
    P = torch.cuda.get_device_properties(dev).multi_processor_count
    rounds = 2000
    N = 1024
    ROWS = triton.next_power_of_2(-(-N // P))
    out = torch.zeros(P, device=dev)
    vec = torch.zeros(2 * N, dtype=torch.bfloat16, device=dev)
    sync = torch.zeros(1, dtype=torch.int32, device=dev)
    for mode, name in ((0, "rows + barrier"), (1, "red f32"), (2, "red v4 f32"), (3, "red u64"),
                       (4, "bulk reduce f32 (cp.reduce.async.bulk)")):
        for copies in ((1,) if mode == 0 else (1, 4)):
            acc = torch.zeros(3 * copies * N, dtype=torch.int64 if mode == 3 else torch.float32, device=dev)

            args = (acc, vec, sync, out, rounds)
            meta = dict(N=N, ROWS=ROWS, MODE=mode, COPIES=copies, num_warps=8)
            smem_off = 0
            if mode == 4:  # the staged partial lies past Triton's own shared memory
                smem_off = reserve_shared_memory(_chain.warmup(*args, 0, grid=(P,), **meta), N * 4)

            def run():
                sync.zero_()
                acc.zero_()
                _chain[(P,)](*args, smem_off, **meta)
            try:
                us = timed(run, reps=5)
                print(f"{name}, {copies} cop{'y' if copies == 1 else 'ies'}: {us / rounds:.3f} us per round "
                      f"(result {out[0].item():.6g})", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"{name}, {copies} copies failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)


if __name__ == "__main__":
    main()
