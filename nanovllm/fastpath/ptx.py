"""Inline-PTX building blocks of the persistent decode kernel (kernel.py).

Why a module of their own: Triton has no grid barrier, no acquire load, no bulk asynchronous copy
(TMA without a tensor map), no mbarrier and no way to read shared memory it does not manage, and
the kernel needs all of them; each is a small `tl.inline_asm_elementwise` wrapper whose PTX and
memory-ordering argument can be read on its own. Host-side helpers sit here too: the tensor-core
projection program's PTX generator (mma_asm) and the patch that reserves the kernel's extra
shared memory. The jit functions run on NVIDIA GPUs only (inline PTX does not run under
TRITON_INTERPRET=1), so the kernel's stepwise launches, which the CPU tests run, use none of
them; the host helpers are tested on the CPU too.
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def load_acquire(ptr):
    """An int32 load with acquire semantics at GPU scope (inline PTX: Triton has no acquire load)."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def grid_arrive(sync_ptr, ONE_THREAD: tl.constexpr = False):
    """Arrive at a grid barrier: count this program at sync_ptr and return the count seen (the
    counter only grows within a launch: barrier n waits for n * num_programs). The CTA barrier
    makes every thread's stores precede the release. What does not depend on the other programs
    (the next stage's weight tiles) is issued between this and grid_wait, so that it overlaps
    the barrier's latency instead of delaying the arrival.

    With tl.atomic_add those loads still wait for the add's answer: Triton hands a scalar
    atomic's result to every thread through shared memory and a CTA barrier. An add whose result
    is unused compiles to a reduction that does not wait, but then the last program to arrive
    must poll once more. ONE_THREAD (decoder.ONE_THREAD_BARRIER): thread 0 adds in inline PTX and
    keeps the answer in its own register, the other threads get 2**31 - 1 (above any target:
    they do not poll), so nothing waits for the answer until thread 0 polls in grid_wait."""
    tl.debug_barrier()
    if ONE_THREAD:
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; mov.u32 $0, 2147483647; "
            "@p atom.acq_rel.gpu.global.add.u32 $0, [$1], 1; @p add.u32 $0, $0, 1; }",
            "=r,l", [sync_ptr], dtype=tl.int32, is_pure=False, pack=1)
    else:
        return tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu") + 1


@triton.jit
def grid_wait(sync_ptr, seen, target):
    """Wait until `target` arrivals have been counted. Polls with acquire loads, so the load that
    sees the count orders this program's later reads after the other programs' released stores
    (the arrival's acq_rel does it for the last program to arrive). With grid_arrive's
    ONE_THREAD only thread 0 polls, and the CTA barrier after the loop passes its acquire on to
    the other threads, as a cooperative grid sync does. Polling with atomics would queue every
    SM's polls behind each other at one L2 address; volatile loads order nothing."""
    while seen < target:
        seen = load_acquire(sync_ptr)
    tl.debug_barrier()


@triton.jit
def wait_count(ptr, target):
    """Wait until the int32 counter at ptr reaches `target`: thread 0 alone polls with acquire loads
    (the other threads start above any target), and grid_wait's CTA barrier passes its acquire
    on to them. For a count that a few programs add to (one KV head's attention parts), where
    grid_arrive/grid_wait are for every program's."""
    seen = tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; mov.u32 $0, 2147483647; "
        "@p mov.u32 $0, 0; }", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1)
    grid_wait(ptr, seen, target)


# Weights through shared memory (SMEM_WEIGHTS, persistent launches on sm_90+): one thread per
# program copies the program's whole slice of a weight stage (its rows are contiguous) into a
# shared-memory slot with one bulk asynchronous copy (cp.async.bulk, the TMA unit), issued two
# weight stages ahead of its use, across the grid barriers between; an mbarrier counts the bytes
# in. The slots lie past Triton's own shared memory, `smem_off` bytes into the kernel's dynamic
# shared memory (`global_smem` in the PTX Triton emits); PersistentDecoder reserves them.
@triton.jit
def shared_address(offset):
    """32-bit shared-memory address `offset` bytes into the kernel's dynamic shared memory."""
    return tl.inline_asm_elementwise("mov.b32 $0, global_smem;\n\tadd.u32 $0, $0, $1;", "=r,r", [offset],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def mbarriers_init(bar_x, bar_y):
    """Thread 0 initialises the two slots' mbarriers (one arrival per phase: the copy's issuer);
    the CTA barrier orders that before any thread waits on them."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p mbarrier.init.shared::cta.b64 [$1], 1; @p mbarrier.init.shared::cta.b64 [$2], 1; "
        "@p fence.mbarrier_init.release.cluster; mov.u32 $0, 0; }",
        "=r,r,r", [bar_x, bar_y], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()


def _bulk_copy_ptx(arrive: bool) -> str:
    """bulk_copy's PTX: with `arrive` the expected bytes come with the phase's one arrival."""
    expect = ("@p mbarrier.arrive.expect_tx.shared::cta.b64 s, [$1], n; " if arrive
              else "@p mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [$1], n; ")
    return ("{ .reg .pred p, q, r; .reg .u32 t, n; .reg .b64 s; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "add.u32 n, $4, $7; setp.ne.and.u32 q, $4, 0, p; setp.ne.and.u32 r, $7, 0, p; "
            "@p fence.proxy.async.shared::cta; " + expect +
            "@q cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$2], [$3], $4, [$1]; "
            "@r cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$5], [$6], $7, [$1]; "
            "mov.u32 $0, 0; }")


_BULK_COPY_ARRIVE = tl.constexpr(_bulk_copy_ptx(True))
_BULK_COPY_EXPECT = tl.constexpr(_bulk_copy_ptx(False))


@triton.jit
def bulk_copy(bar, dst, src, nbytes, dst2, src2, nbytes2, ARRIVE: tl.constexpr = True):
    """Thread 0: expect nbytes + nbytes2 at mbarrier `bar`, then copy nbytes from global `src` to
    shared `dst` (and nbytes2 from src2 to dst2) asynchronously; an empty copy is skipped (with
    both empty the phase completes at once). The proxy fence orders the CTA's earlier reads of
    the slot (a CTA barrier precedes every call) before the copy's writes. ARRIVE=False: only
    expect the bytes, without the phase's one arrival, so that a later call (ARRIVE=True) can
    copy the rest of the phase's bytes: the phase completes when that call has arrived and all
    the bytes of both have landed."""
    tl.inline_asm_elementwise(_BULK_COPY_ARRIVE if ARRIVE else _BULK_COPY_EXPECT, "=r,r,r,l,r,r,l,r",
                              [bar, dst, src, nbytes, dst2, src2, nbytes2], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _mbarrier_test(bar, parity):
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; selp.u32 $0, 1, 0, p; }",
        "=r,r,r", [bar, parity], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def mbarrier_wait(bar, parity):
    """Every thread waits until the phase of parity `parity` of mbarrier `bar` has completed: its
    copy has landed, and the completion makes the bytes visible to the threads that waited."""
    done = _mbarrier_test(bar, parity)
    while done == 0:
        done = _mbarrier_test(bar, parity)


@triton.jit
def slot_tile(slot, w_ptr, rmask, k0, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns k0:k0 + BLOCK_K of the [BLOCK_R rows, K] slice of weight w_ptr at shared address `slot`
    (the program's rows, row-major), read with 16-byte shared loads. Masked rows read row 0 again
    (their results are never stored); the host keeps K a multiple of BLOCK_K. The loads are
    inline PTX, which takes its register layout from the address tensor: Triton gives that the
    layout of the tile's vectorized global loads, eight consecutive 16-bit columns (four fp32)
    per thread, so that one instance's elements are one aligned 16-byte line (the GPU tests
    compare this path with the register one, bit for bit). Not pure: the compiler must neither
    merge two loads of one address (a slot holds another stage's rows by then) nor move them
    before the mbarrier wait."""
    dtype = w_ptr.dtype.element_ty
    ESIZE: tl.constexpr = dtype.primitive_bitwidth // 8
    local = tl.where(rmask, tl.arange(0, BLOCK_R), 0)
    addr = slot + (local[:, None] * K + (k0 + tl.arange(0, BLOCK_K))[None, :]) * ESIZE
    if ESIZE == 2:
        return tl.inline_asm_elementwise("ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];",
                                         "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [addr], dtype=dtype, is_pure=False, pack=8)
    else:
        return tl.inline_asm_elementwise("ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];",
                                         "=r,=r,=r,=r,r,r,r,r", [addr], dtype=dtype, is_pure=False, pack=4)


@triton.jit
def stage_to_shared(x, offs, mask, xbuf):
    """Store the 16-bit values x (at element offsets offs, where mask) into shared memory at xbuf:
    a projection's input for the tensor-core path (mma_rows). One st.shared.b16 per element
    (pack=1: right whatever register layout Triton gives x)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $3, 0; @p st.shared.b16 [$1], $2; mov.u32 $0, 0; }",
        "=r,r,h,r", [xbuf + offs * 2, x, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def stage_f32_to_shared(x, offs, mask, buf):
    """Store x as fp32 at element offsets offs (where mask) of shared memory at buf (pack=1: right
    whatever register layout Triton gives x; copies of one element store the same value)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $3, 0; @p st.shared.f32 [$1], $2; mov.u32 $0, 0; }",
        "=r,r,f,r", [buf + offs * 4, x.to(tl.float32), mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def stage_i32_to_shared(x, offs, mask, buf):
    """Store the int32 values x at element offsets offs (where mask) of shared memory at buf."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $3, 0; @p st.shared.b32 [$1], $2; mov.u32 $0, 0; }",
        "=r,r,r,r", [buf + offs * 4, x.to(tl.int32), mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def loop_zero(IN_LOOP: tl.constexpr):
    """0; IN_LOOP: from an instruction the compiler may neither fold nor move. Added to a
    tl.arange inside a loop, it keeps the compiler from computing the arange's values (and all
    that follows from them alone) once before the loop and holding them in registers through
    it: the persistent decode kernel's LM head, inside its loop of decode steps (MULTI_STEP),
    would hold ~17 registers more so, and the layers (the same loop) run slower. Outside such a
    loop a plain 0: there the opaque one makes the kernel slower."""
    if IN_LOOP:
        return tl.inline_asm_elementwise("mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    else:
        return 0


@triton.jit
def prefetch_l2(ptr, nbytes, mask):
    """Start fetching nbytes (a multiple of 16) at the 16-byte aligned global address ptr into
    the L2 (one bulk prefetch per element where mask; nothing waits for it)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [ptr.to(tl.int64), nbytes, mask.to(tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def shared_i32(offs, mask, buf):
    """The int32 values at element offsets offs of shared memory at buf (0 where not mask). Not
    pure: the caller's CTA barrier orders it after the stores it reads."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; mov.b32 $0, 0; @p ld.shared.b32 $0, [$1]; }",
        "=r,r,r", [buf + offs * 4, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def shared_f32(offs, mask, buf):
    """The fp32 values at element offsets offs of shared memory at buf (see shared_i32)."""
    return shared_i32(offs, mask, buf).to(tl.float32, bitcast=True)


@triton.jit
def down_rows(DOWN_ASM: tl.constexpr, slot, act, acc, valid, THREADS: tl.constexpr):
    """Run the K-split down projection's program (`down_asm` below) on every thread."""
    t = tl.arange(0, THREADS)
    tl.inline_asm_elementwise(DOWN_ASM, "=r,r,r,l,r,r", [slot + t * 0, act, acc.to(tl.int64), t, valid],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def mma_rows(MMA_ASM: tl.constexpr, slot, xbuf, red, THREADS: tl.constexpr):
    """Run a projection slice's tensor-core program (`mma_asm` below) on every thread; returns,
    per thread index t [THREADS] (fp32), the results of slice rows t and t + its second row
    offset (gate_up's up rows; the others ignore it)."""
    t = tl.arange(0, THREADS)
    return tl.inline_asm_elementwise(MMA_ASM, "=f,=f,r,r,r,r", [slot + t * 0, xbuf, red, t],
                                     dtype=(tl.float32, tl.float32), is_pure=False, pack=1)


def down_asm(rows: int, h: int, threads: int, dtype: torch.dtype) -> str:
    """PTX for one program's share of a K-split projection whose sums meet in global memory:
    acc[c] += sum over r < valid of act[r] * W[r, c] for every column c < h, with W the `rows`
    rows [rows, h] of a shared-memory slot (the program's rows of the transposed down weight)
    and act fp32 in shared memory. Thread t takes columns 4t, 4t + 1, 4t + 2, 4t + 3 (then
    4 * threads further, and so on), walks the rows in order with one FMA per weight and adds its
    four sums with one 16-byte reduction (red...v4.f32, sm_90). Every thread reads act[r] (a
    broadcast) and 4 consecutive weights of a row: a warp reads 128 (16-bit) or 256 bytes of one
    row, without bank conflicts. Rows at or past `valid` (the last program's short slice; the
    slot holds stale bytes there) are skipped. Needs h a multiple of 4 and acc 16-byte aligned.
    Operands: $0 unused result, $1 slot, $2 act, $3 acc (a global address), $4 t, $5 valid."""
    if h % 4:
        raise ValueError(f"the K-split down projection needs hidden a multiple of 4, got {h}")
    esize = dtype.itemsize
    out = ["{", ".reg .u32 c, wa;", ".reg .u64 ga, off;", ".reg .pred p, q;", ".reg .b32 w0, w1, w2, w3;",
           ".reg .b16 h0, h1;", ".reg .f32 a, x0, x1, x2, x3, s0, s1, s2, s3;"]
    for j in range(-(-h // (4 * threads))):
        out += [f"mad.lo.u32 c, $4, 4, {j * 4 * threads};", f"setp.lt.u32 p, c, {h};",
                f"mad.lo.u32 wa, c, {esize}, $1;"]
        out += [f"mov.f32 s{i}, 0f00000000;" for i in range(4)]
        for r in range(rows):
            out += [f"setp.gt.and.u32 q, $5, {r}, p;", f"@q ld.shared.f32 a, [$2+{r * 4}];"]
            row = r * h * esize
            if esize == 4:
                out += [f"@q ld.shared.v4.b32 {{w0, w1, w2, w3}}, [wa+{row}];"]
                xs = ["w0", "w1", "w2", "w3"]
                out += [f"mov.b32 x{i}, {w};" for i, w in enumerate(xs)]
            else:
                out.append(f"@q ld.shared.v2.b32 {{w0, w1}}, [wa+{row}];")
                for i, w in enumerate(("w0", "w1")):
                    if dtype == torch.bfloat16:  # a bf16 is the top half of the fp32 with the same value
                        out += [f"shl.b32 x{2 * i}, {w}, 16;", f"and.b32 x{2 * i + 1}, {w}, 0xffff0000;"]
                    else:
                        out += [f"mov.b32 {{h0, h1}}, {w};", f"cvt.f32.f16 x{2 * i}, h0;", f"cvt.f32.f16 x{2 * i + 1}, h1;"]
            out += [f"@q fma.rn.f32 s{i}, x{i}, a, s{i};" for i in range(4)]
        out += ["cvt.u64.u32 off, c;", "shl.b64 off, off, 2;", "add.u64 ga, $3, off;",
                "@p red.relaxed.gpu.global.add.v4.f32 [ga], {s0, s1, s2, s3};"]
    out += ["mov.u32 $0, 0;", "}"]
    return "\n\t".join(out)


def reserve_shared_memory(kernel: Any, extra: int) -> int:
    """Make a compiled kernel launch with `extra` bytes of dynamic shared memory past Triton's own
    and return the offset where they start (a multiple of 128). Triton sizes a launch's dynamic
    shared memory from the kernel's metadata, and raises the kernel's limit to the device's
    opt-in maximum when it loads the module if that size is above 48 KB; so this has to run
    before the kernel's first launch. Idempotent."""
    own = getattr(kernel, "_nanovllm_own_shared", None)
    if own is None:
        if kernel.module is not None:
            raise RuntimeError("persistent decode: the kernel was launched before its shared memory was reserved")
        from triton.compiler.compiler import make_backend

        own = kernel.metadata.shared
        kernel.metadata = kernel.metadata._replace(shared=align_up(own, 128) + extra)
        kernel.packed_metadata = make_backend(kernel.metadata.target).pack_metadata(kernel.metadata)
        kernel._nanovllm_own_shared = own
    return align_up(own, 128)


def align_up(n: int, to: int) -> int:
    return -(-n // to) * to


# Elements of K one tensor-core step of mma_asm covers: 16 chunks of 8.
MMA_K_STEP = 128


def mma_asm(rows: int, k: int, warps: int, row2: int, dtype: torch.dtype) -> str:
    """PTX for one program's slice of a projection on tensor cores (MMA_* of _decode_kernel):
    y[r] = sum_k W[r, k] x[k] for the `rows` rows of a shared-memory slot (16-bit, row-major
    [rows, k], as the bulk copy left them) and x in shared memory at xbuf (16-bit, [k]).
    dtype torch.int8: int8 rows (the quantized LM head, head_quant.py) and an fp16 x;
    see below.

    The weights are the mma's A operand without any re-layout, by a change of what its rows mean:
    one mma.m16n8k16 takes two weight rows r and r' (a pair) over 128 columns, A's row m (m < 8)
    being chunk m of row r (8 columns) and its k the columns within the chunk (chunk m + 8 for k
    >= 8; rows 8-15 the same chunks of r'), and B's column n the input's chunks n and n + 8. The
    product's diagonal D[m][m] (D[8 + m][m] for r') is chunk m's share of the dot product; the
    rest is discarded. ldmatrix.x4's eight row addresses per matrix are then eight consecutive
    16-byte chunks of one row, in eight different bank groups: no conflicts (rows 2 KB apart, the
    plain mapping, hit one bank group 8 times; padding rows would cost a bulk copy per row). Eight of the 64 products per row pair count,
    which the tensor cores do in far fewer instructions than the FMA path's conversions and FMAs.

    Warps take whole pairs (each accumulates its pairs over all of K) while there are at least as
    many pairs as warps; else warps // pairs warps share a pair, each taking every
    (warps // pairs)-th 128-column step. A warp sums each pair's diagonal with butterfly shuffles
    and lane 0 writes the pair's two sums to `red` ([k-parts, 2 * pairs] fp32); after a CTA
    barrier, thread t adds row t's k-parts in order (and row t + row2's: gate_up's up rows).
    Rows past `rows` (an odd count's last pair) repeat the last row; their results are not used.
    int8 rows: a 128-column step of a pair is 128 bytes of each row, one ldmatrix.x2 (matrix 0
    row r's 8 chunks of 16, matrix 1 row r''s), so thread (grp, tig) holds bytes 4 tig..4 tig + 3
    of chunk grp of both rows. Each byte b becomes the fp16 1,024 + (b xor 128) by a byte
    permute under the constant 0x64, less 1,152 (exact: integers below 2,048 are fp16s), and
    the pair's mma.f16 takes columns 4 tig, 4 tig + 1 as A's k = 2 tig, 2 tig + 1 and 4 tig + 2,
    4 tig + 3 as k = 2 tig + 8, 2 tig + 9, with x's same four columns as B's: a thread gives A
    row grp's and B column grp's values at the same k, so the diagonal is the same dot product.

    Operands: $0 $1 results, $2 slot, $3 xbuf, $4 red, $5 t (the thread's element index). Every
    thread must run it as often as the others (mma.sync, shfl.sync, bar.sync): mma_rows hands it
    a [threads] tensor, one element per thread."""
    if k % MMA_K_STEP:
        raise ValueError(f"tensor-core projections need K a multiple of {MMA_K_STEP}, got {k}")
    int8 = dtype == torch.int8
    ty = {torch.bfloat16: "bf16", torch.float16: "f16", torch.int8: "f16"}[dtype]
    pairs = -(-rows // 2)
    steps = k // MMA_K_STEP
    step_bytes = MMA_K_STEP * (1 if int8 else 2)  # of a weight row (x's step is MMA_K_STEP * 2 bytes)
    row_bytes = k * (1 if int8 else 2)
    split = 1 if pairs >= warps else warps // pairs
    pair_slots = -(-pairs // warps) if split == 1 else 1
    steps_per_warp = -(-steps // split)
    width = 2 * pairs
    acc = [[f"c{j}_{i}" for i in range(4)] for j in range(pair_slots)]
    out = ["{",
           ".reg .u32 tid, lane, warp, grp, tig, kp, lo, sel, xa, t, pr, r1, r2;",
           ".reg .b32 a0, a1, a2, a3, b0, b1, w0, w1, bias, magic;",
           ".reg .f32 s, v, w, x, " + ", ".join(c for slot in acc for c in slot) + ";",
           ".reg .pred act, d0, d1, q, sp, " + ", ".join(f"v{j}" for j in range(pair_slots)) + ";",
           ".reg .u32 " + ", ".join(f"wa{j}" for j in range(pair_slots)) + ";",
           "mov.u32 tid, %tid.x;", "and.b32 lane, tid, 31;", "shr.u32 warp, tid, 5;",
           "shr.u32 grp, lane, 2;", "and.b32 tig, lane, 3;",
           # ldmatrix: lane l gives row (l & 7) of matrix l >> 3: chunk (l & 7) + 8 * (l >> 4) of row r or r'
           # (int8, .x2: chunk l & 7 of row r or r'; lanes 16-31 repeat lanes 0-15's addresses)
           "and.b32 lo, lane, 7;", "shl.b32 lo, lo, 4;", "shr.u32 t, lane, 4;", "shl.b32 t, t, 7;",
           "add.u32 lo, lo, t;" if not int8 else "mov.u32 bias, 0x64806480;\n\tmov.u32 magic, 0x64646464;",
           "shr.u32 sel, lane, 3;", "and.b32 sel, sel, 1;",
           # the diagonal: D[grp][2 tig] (c0, c2) or D[grp][2 tig + 1] (c1, c3)
           "shl.b32 t, tig, 1;", "setp.eq.u32 d0, grp, t;", "add.u32 t, t, 1;", "setp.eq.u32 d1, grp, t;"]
    if split == 1:
        out += ["mov.u32 kp, 0;", "setp.eq.u32 act, kp, 0;"]
    else:
        out += [f"rem.u32 pr, warp, {pairs};", f"div.u32 kp, warp, {pairs};", f"setp.lt.u32 act, kp, {split};"]
    # x operand: chunk grp (b0) and grp + 8 (b1) of the step, 2 elements at tig * 2 (int8: columns
    # 16 grp + 4 tig .. + 3 of the step, b0 and b1 in one 8-byte load)
    if int8:
        out += ["shl.b32 xa, grp, 5;", "shl.b32 t, tig, 3;"]
    else:
        out += ["shl.b32 xa, grp, 4;", "shl.b32 t, tig, 2;"]
    out += ["add.u32 xa, xa, t;", "add.u32 xa, xa, $3;", f"mad.lo.u32 xa, kp, {MMA_K_STEP * 2}, xa;"]
    for j in range(pair_slots):
        if split == 1:
            out.append(f"add.u32 pr, warp, {j * warps};")
        out += [f"setp.lt.and.u32 v{j}, pr, {pairs}, act;",
                "shl.b32 r1, pr, 1;", f"min.u32 r1, r1, {rows - 1};", "shl.b32 r2, pr, 1;", "add.u32 r2, r2, 1;",
                f"min.u32 r2, r2, {rows - 1};", "setp.ne.u32 q, sel, 0;", "selp.u32 t, r2, r1, q;",
                f"mad.lo.u32 wa{j}, t, {row_bytes}, lo;", f"add.u32 wa{j}, wa{j}, $2;",
                f"mad.lo.u32 wa{j}, kp, {step_bytes}, wa{j};"]
        out += [f"mov.f32 {c}, 0f00000000;" for c in acc[j]]
    for i in range(steps_per_warp):
        offset = i * split * step_bytes
        x_offset = i * split * MMA_K_STEP * 2
        out += [f"add.u32 t, kp, {i * split};", f"setp.lt.and.u32 sp, t, {steps}, act;"]
        if int8:
            out.append(f"@sp ld.shared.v2.b32 {{b0, b1}}, [xa+{x_offset}];")
        else:
            out += [f"@sp ld.shared.b32 b0, [xa+{x_offset}];", f"@sp ld.shared.b32 b1, [xa+{x_offset + 128}];"]
        for j in range(pair_slots):
            c = ", ".join(acc[j])
            out.append(f"setp.lt.and.u32 q, t, {steps}, v{j};")
            if int8:
                out += [f"@q ldmatrix.sync.aligned.m8n8.x2.shared.b16 {{w0, w1}}, [wa{j}+{offset}];",
                        "xor.b32 w0, w0, 0x80808080;", "xor.b32 w1, w1, 0x80808080;",
                        "prmt.b32 a0, w0, magic, 0x4140;", "prmt.b32 a2, w0, magic, 0x4342;",
                        "prmt.b32 a1, w1, magic, 0x4140;", "prmt.b32 a3, w1, magic, 0x4342;"]
                out += [f"sub.f16x2 a{n}, a{n}, bias;" for n in range(4)]
            else:
                out.append(f"@q ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{a0, a1, a2, a3}}, [wa{j}+{offset}];")
            out.append(f"@q mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{{c}}}, {{a0, a1, a2, a3}}, {{b0, b1}}, {{{c}}};")
    # each pair's diagonal summed over the warp; lane 0 writes red[kp][2 pr (+1)]
    out += ["setp.eq.u32 q, lane, 0;"]
    for j in range(pair_slots):
        c0, c1, c2, c3 = acc[j]
        if split == 1:
            out.append(f"add.u32 pr, warp, {j * warps};")
        out += ["mov.f32 v, 0f00000000;", "mov.f32 w, 0f00000000;",
                f"@d0 mov.f32 v, {c0};", f"@d1 mov.f32 v, {c1};", f"@d0 mov.f32 w, {c2};", f"@d1 mov.f32 w, {c3};"]
        for off in (16, 8, 4, 2, 1):
            out += [f"shfl.sync.bfly.b32 x, v, {off}, 31, -1;", "add.f32 v, v, x;",
                    f"shfl.sync.bfly.b32 x, w, {off}, 31, -1;", "add.f32 w, w, x;"]
        out += [f"mad.lo.u32 t, kp, {width}, pr;", "add.u32 t, t, pr;", "shl.b32 t, t, 2;", "add.u32 t, t, $4;",
                f"and.pred sp, q, v{j};", "@sp st.shared.f32 [t], v;", "@sp st.shared.f32 [t+4], w;"]
    out.append("bar.sync 0;")
    for dst, offset in (("$0", 0), ("$1", row2)):
        out += [f"add.u32 t, $5, {offset};", f"min.u32 t, t, {width - 1};", "shl.b32 t, t, 2;", "add.u32 t, t, $4;",
                "mov.f32 s, 0f00000000;"]
        for kp in range(split):
            out += [f"ld.shared.f32 x, [t+{kp * width * 4}];", "add.f32 s, s, x;"]
        out.append(f"mov.f32 {dst}, s;")
    out.append("}")
    return "\n\t".join(out)
