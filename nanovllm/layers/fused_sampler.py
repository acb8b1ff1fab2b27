"""One-kernel sampling for the common case: temperature (or greedy) and nothing else.

The reference sampler (sampler.py) runs ~6 full-vocabulary passes per step (fp32 cast, divide,
softmax, exponential noise, divide, argmax); on a 151,936-token vocabulary at batch 256 that
is about a tenth of a decode step. Here the logits are streamed once, in their own
dtype, keeping a running argmax of `logits / T + Gumbel noise` (greedy rows: of the
logits), which draws exactly from softmax(logits / T) (the Gumbel-max trick). The noise is
Philox (`tl.rand4x`) keyed by a per-step seed that is drawn on the device from torch's RNG (so
`torch.manual_seed` still governs it and there is no host sync) and by the element's position.

The vocabulary of each row is cut into contiguous chunks, one program each, and a second small
kernel picks the best chunk per row: with one program per row, a 256-row batch left most of each
SM idle. The split count is chosen from the shapes only and passed at run time, so one compiled
kernel serves every batch (the runner's profiling step compiles it: nothing compiles in the
middle of a run). The noise of an element depends on its position alone, so the sampled token is
the same for every split count. One Philox call feeds four elements (`tl.rand4x`), and each lane
keeps its own running best until one reduction at the end.

The scan is bound by instruction issue, not by memory: two precise logs of the Gumbel noise
would be about half its instructions per element. On the GPU they are one MUFU.LG2 each
(`_gumbel` keeps the noise's upper tail exact, see there) and columns are 32-bit
(`benchmarks/sampler.py` times the pass). Under the interpreter (CPU tests) the
precise log runs instead; the noise function is checked against float64 on both.

Only batches without top-k / top-p / min-p, without seeded requests (they keep their own
torch.Generator stream, so they are reproducible whatever the batch) and without logprobs take
this path; everything else stays on the reference path. Grammar masks (one bitmask row per
constrained row) are read in the same scan: a disallowed token never scores. Ties go to the
lowest token id, as torch.argmax does.

A batch of greedy rows under grammar masks takes `MaskedGreedy` instead: no noise, one launch
(each row's last program to finish picks its best chunk), and its workspace is kept from batch
to batch. `GreedyRow` is the one-row argmax of the lone-sequence graphs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.precompile import launch

BLOCK_V = 2048
# 8-warp programs wanted per SM (8 x 8 = 64 warps, a Hopper SM's maximum).
_PROGRAMS_PER_SM = 8
MAX_SPLITS = 32


def sm_count(device: torch.device) -> int:
    """The device's SM count, for choose_num_splits; 4 off CUDA (the Triton interpreter in tests)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def choose_num_splits(rows: int, vocab_size: int, num_sms: int) -> int:
    """Vocabulary chunks per row: enough programs to fill every SM, each at least 2 tiles long."""
    if rows == 0:
        return 1
    by_occupancy = triton.next_power_of_2(triton.cdiv(_PROGRAMS_PER_SM * num_sms, rows))
    by_length = 1 << (max(1, vocab_size // (2 * BLOCK_V)).bit_length() - 1)  # a power of two
    return max(1, min(MAX_SPLITS, by_occupancy, by_length))


@triton.jit
def _neg_log(x, FAST: tl.constexpr):
    """-ln(x) for positive normal x: one MUFU.LG2 where FAST (absolute error ~2^-22 in log2),
    else the precise polynomial logf (what the interpreter runs)."""
    if FAST:
        lg2 = tl.inline_asm_elementwise(
            "lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
        return lg2 * -0.6931471805599453
    else:
        return -tl.log(x)


@triton.jit
def _gumbel(u, FAST: tl.constexpr):
    """Gumbel noise -ln(-ln u) for u uniform in [0, 1) (Triton's u is at most 1 - 2^-23).

    E = -ln(u) is tiny near u = 1, which is where the noise's upper tail, and so the sampled
    token, comes from: there a fast log's absolute error would swamp E, so for t = 1 - u < 1/64
    (t exact) E = t + t^2/2 + t^3/3 (relative error < t^3/4 < 2^-20). Elsewhere |log2 u| > 1/45
    and the fast log's error stays under 2^-15 of E. u = 0 is clamped (noise -3.8, harmless)."""
    t = 1.0 - u
    series = t * (1.0 + t * (0.5 + t * 0.3333333333333333))
    e = tl.where(t < 0.015625, series, _neg_log(tl.maximum(u, 1e-20), FAST))
    return _neg_log(e, FAST)


@triton.jit
def gumbel_noise(cols, seed, BLOCK: tl.constexpr, FAST: tl.constexpr):
    """The Gumbel noise that _gumbel_argmax_kernel (tiles of BLOCK) adds to column `cols` of row 0
    under `seed`: the same Philox call, counter and lane. cols: int32 columns."""
    QUARTER: tl.constexpr = BLOCK // 4
    within = cols % BLOCK
    u0, u1, u2, u3 = tl.rand4x(seed, (cols - within) // 4 + within % QUARTER)
    lane = within // QUARTER
    u = tl.where(lane == 0, u0, tl.where(lane == 1, u1, tl.where(lane == 2, u2, u3)))
    return _gumbel(u, FAST)


@triton.jit
def gumbel_score(x, cols, inv_t, seed, BLOCK: tl.constexpr, FAST: tl.constexpr):
    """x * inv_t plus gumbel_noise(cols): a kernel that keeps the best of these scores over a row
    samples the token gumbel_argmax would (the persistent decode kernel's LM head does,
    fastpath/head.py). The score only grows with x (each rounding does), which the
    quantized head's bounds rely on."""
    return x * inv_t + gumbel_noise(cols, seed, BLOCK, FAST)


@triton.jit
def mask_allows(words_ptr, mask_row, cols, valid):
    """valid & whether each column's bit is set in the mask row at words_ptr (bit c % 32 of word
    c // 32); every column counts as allowed where mask_row is -1 (no grammar)."""
    # (mask_row broadcast over the columns first: Triton's interpreter cannot combine a
    # block's mask with a scalar condition; the compiler folds cols * 0 away.)
    words = tl.load(words_ptr + cols // 32, mask=valid & ((cols * 0 + mask_row) >= 0), other=-1)
    return valid & (((words >> (cols % 32)) & 1) != 0)


@triton.jit
def _keep_best(best_val, best_idx, row_ptr, cols, hi, u, inv_t, noise_scale, words_ptr, mask_row,
               FAST: tl.constexpr, HAS_MASK: tl.constexpr):
    """Fold one quarter-tile into the per-lane running best (no cross-lane reduction). With
    HAS_MASK, a row whose mask_row is not -1 keeps only the columns whose bit is set in its
    mask words (bit c % 32 of word c // 32)."""
    valid = cols < hi
    if HAS_MASK:
        valid = mask_allows(words_ptr, mask_row, cols, valid)
    x = tl.load(row_ptr + cols, mask=valid, other=float("-inf")).to(tl.float32)
    score = tl.where(valid, x * inv_t + _gumbel(u, FAST) * noise_scale, float("-inf"))
    better = score > best_val  # strict: each lane sees its columns in increasing order
    return tl.where(better, score, best_val), tl.where(better, cols, best_idx)


@triton.jit(do_not_specialize=("chunk", "num_splits"))
def _gumbel_argmax_kernel(
    logits_ptr,
    temperature_ptr,
    seed_ptr,
    best_val_ptr,
    best_idx_ptr,
    stride_row,
    vocab_size,
    chunk,
    num_splits,
    mask_ptr,
    mask_row_ptr,
    mask_stride,
    BLOCK: tl.constexpr,
    FAST_LOG: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    """Program (row, split) scans columns [split * chunk, (split + 1) * chunk) of its row.

    One Philox call yields four uniforms (`tl.rand4x`), so a BLOCK tile is read as four
    quarter-tiles that share one call per column: counter = the quarter-tile column's absolute
    position / 4 in the row (tiles start at multiples of BLOCK, so chunks never change which
    uniform an element gets), lane = which quarter. Each lane keeps its own running best and
    the lanes are reduced once at the end: a reduction per tile (a barrier across 8 warps)
    would cost more than the tile's loads. Columns and counters are 32-bit (the caller checks
    that rows x vocabulary fits): the loop is bound by instruction issue, not by memory.
    HAS_MASK: row r samples among the tokens allowed by row mask_row_ptr[r] of the int32 bitmask
    at mask_ptr (mask_stride words a row), or among all where that is -1."""
    QUARTER: tl.constexpr = BLOCK // 4
    row = tl.program_id(0)
    split = tl.program_id(1)
    t = tl.load(temperature_ptr + row)
    greedy = t == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, t)
    noise_scale = tl.where(greedy, 0.0, 1.0)
    seed = tl.load(seed_ptr)
    offs = tl.arange(0, QUARTER)
    best_val = tl.full((QUARTER,), float("-inf"), tl.float32)
    best_idx = tl.full((QUARTER,), 0, tl.int32)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    words_ptr = mask_ptr
    mask_row = -1
    if HAS_MASK:
        mask_row = tl.load(mask_row_ptr + row)
        words_ptr = mask_ptr + tl.maximum(mask_row, 0).to(tl.int64) * mask_stride
    row_counter = row * tl.cdiv(vocab_size, BLOCK) * QUARTER
    lo = split * chunk
    hi = tl.minimum(vocab_size, lo + chunk)
    for start in range(lo, hi, BLOCK):
        u0, u1, u2, u3 = tl.rand4x(seed, row_counter + start // 4 + offs)
        cols = start + offs
        best_val, best_idx = _keep_best(best_val, best_idx, row_ptr, cols, hi, u0, inv_t, noise_scale,
                                        words_ptr, mask_row, FAST_LOG, HAS_MASK)
        best_val, best_idx = _keep_best(best_val, best_idx, row_ptr, cols + QUARTER, hi, u1, inv_t, noise_scale,
                                        words_ptr, mask_row, FAST_LOG, HAS_MASK)
        best_val, best_idx = _keep_best(best_val, best_idx, row_ptr, cols + 2 * QUARTER, hi, u2, inv_t, noise_scale,
                                        words_ptr, mask_row, FAST_LOG, HAS_MASK)
        best_val, best_idx = _keep_best(best_val, best_idx, row_ptr, cols + 3 * QUARTER, hi, u3, inv_t, noise_scale,
                                        words_ptr, mask_row, FAST_LOG, HAS_MASK)
    top = tl.max(best_val, axis=0)
    # Lowest column among the lanes holding the maximum (ties go to the lowest token id).
    top_idx = tl.min(tl.where(best_val == top, best_idx, tl.full((QUARTER,), 2**31 - 1, tl.int32)), axis=0)
    tl.store(best_val_ptr + row * num_splits + split, top)
    tl.store(best_idx_ptr + row * num_splits + split, top_idx.to(tl.int64))


@triton.jit(do_not_specialize=("num_splits",))
def _best_split_kernel(best_val_ptr, best_idx_ptr, out_ptr, num_splits, MAX: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, MAX)
    vals = tl.load(best_val_ptr + row * num_splits + offs, mask=offs < num_splits, other=float("-inf"))
    # Chunks are in token order, so the first best chunk holds the lowest tied token id.
    winner = tl.argmax(vals, axis=0, tie_break_left=True)
    tl.store(out_ptr + row, tl.load(best_idx_ptr + row * num_splits + winner))


def check_mask(caller: str, words: torch.Tensor, row_of: torch.Tensor, rows: int, vocab_size: int) -> None:
    """ValueError naming the argument unless (words, row_of) are grammar masks the kernels read
    for `rows` rows of `vocab_size` logits (structured/bitmask.py TokenBitmask)."""
    if words.dtype != torch.int32 or words.dim() != 2 or words.stride(1) != 1 or words.shape[1] * 32 < vocab_size:
        raise ValueError(f"{caller}: mask words must be int32 [R, >= {triton.cdiv(vocab_size, 32)}] with "
                         f"contiguous rows, got {words.dtype} {tuple(words.shape)}")
    if row_of.dtype != torch.int32 or row_of.shape != (rows,):
        raise ValueError(f"{caller}: mask row_of must be int32 [{rows}], got {row_of.dtype} {tuple(row_of.shape)}")


def gumbel_argmax(
    logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, num_splits: int | None = None,
    mask: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Sample one token per row of logits [B, V] at the row's temperature (0 = greedy).

    temperature: [B] float32 on the device; seed: a one-element int64 device tensor.
    num_splits: vocabulary chunks per row (a power of two up to MAX_SPLITS); None chooses from
    the shapes. It is a runtime argument: one compiled kernel serves every batch.
    mask: (words, row_of), grammar masks (structured/bitmask.py TokenBitmask): words int32
    [R, ceil(V / 32)] on the device, bit t of a row set = token t allowed; row_of int32 [B], the
    row of words that batch row samples under, -1 for none. A row samples among its allowed
    tokens as it would from logits whose other tokens were -inf (the noise is the same)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"gumbel_argmax: logits must be [B, V] with contiguous rows, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if not rows:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(rows, vocab, sm_count(logits.device))
    if not 1 <= num_splits <= MAX_SPLITS or num_splits & (num_splits - 1):
        raise ValueError(f"gumbel_argmax: num_splits must be a power of two in [1, {MAX_SPLITS}], got {num_splits}")
    if rows * triton.cdiv(vocab, BLOCK_V) * BLOCK_V >= 2**31:
        raise ValueError(f"gumbel_argmax: {rows} rows x {vocab} columns overflow the kernel's 32-bit indices")
    chunk = triton.cdiv(triton.cdiv(vocab, num_splits), BLOCK_V) * BLOCK_V  # whole tiles per chunk
    best_val = torch.empty((rows, num_splits), dtype=torch.float32, device=logits.device)
    best_idx = torch.empty((rows, num_splits), dtype=torch.int64, device=logits.device)
    if mask is not None:
        words, row_of = mask
        check_mask("gumbel_argmax", words, row_of, rows, vocab)
        mask_args = (words, row_of, words.stride(0))
    else:
        mask_args = (best_idx, best_idx, 0)  # not read
    launch(
        _gumbel_argmax_kernel, (rows, num_splits),
        logits, temperature, seed, best_val, best_idx, logits.stride(0), vocab, chunk, num_splits, *mask_args,
        BLOCK=BLOCK_V, FAST_LOG=logits.is_cuda, HAS_MASK=mask is not None,
        num_warps=8,  # CPU tensors: the interpreter, no PTX
    )
    launch(_best_split_kernel, (rows,), best_val, best_idx, out, num_splits, MAX=MAX_SPLITS, num_warps=1)
    return out


# A lone greedy sequence (the fast path's graphs, nanovllm/fastpath/graphs.py): one row, one
# launch across the vocabulary; torch.argmax reduces a [1, 151,936] row in one thread block.
GREEDY_BLOCK = 2048


@triton.jit
def best_part(part_val_ptr, part_idx_ptr, n, PARTS: tl.constexpr):
    """The index of the best of n parts' (value, index) pairs, the lowest index among equal
    values: what the last program of a split argmax picks (GreedyRow, and the persistent decode
    kernel's LM head). Reads through the L2 (.cg), where the other programs' released stores are."""
    offs = tl.arange(0, PARTS)
    live = offs < n
    vals = tl.load(part_val_ptr + offs, mask=live, other=float("-inf"), cache_modifier=".cg")
    idxs = tl.load(part_idx_ptr + offs, mask=live, other=2**31 - 1, cache_modifier=".cg")
    top = tl.max(vals, axis=0)
    return tl.min(tl.where(live & (vals == top), idxs, 2**31 - 1), axis=0)


@triton.jit
def _greedy_row_kernel(logits_ptr, part_val_ptr, part_idx_ptr, count_ptr, out_ptr, vocab_size,
                       BLOCK: tl.constexpr, PARTS: tl.constexpr):
    """Program p takes columns [p * BLOCK, (p + 1) * BLOCK), stores its best (value, lowest
    column) and counts itself in; the last program to arrive (acq_rel count) picks the best part,
    lowest column on ties, and puts the count back to 0 for the next launch."""
    pid = tl.program_id(0)
    n = tl.num_programs(0)
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
    best = tl.max(x, axis=0)
    best_col = tl.min(tl.where(x == best, cols, 2**31 - 1), axis=0)
    tl.store(part_val_ptr + pid, best)
    tl.store(part_idx_ptr + pid, best_col)
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == n - 1:
        tl.store(out_ptr, best_part(part_val_ptr, part_idx_ptr, n, PARTS).to(tl.int64))
        tl.store(count_ptr, 0)


class GreedyRow:
    """`greedy(logits [1, V], out [1] int64)`: out = argmax of the row, the lowest token id on
    ties, as torch.argmax (a NaN logit is not handled as torch does: rows with NaNs are broken
    anyway). One launch of ceil(V / GREEDY_BLOCK) programs and graph-capturable: the workspace
    (each program's best and an arrival count that the last program resets) lives here, so one
    instance serves one stream of launches at a time."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        if vocab_size < 1 or vocab_size >= 2**31 - GREEDY_BLOCK:
            raise ValueError(f"GreedyRow: vocab_size must be in [1, 2**31 - {GREEDY_BLOCK}), got {vocab_size}")
        self.vocab_size = vocab_size
        self.programs = triton.cdiv(vocab_size, GREEDY_BLOCK)
        self.part_val = torch.empty(self.programs, dtype=torch.float32, device=device)
        self.part_idx = torch.empty(self.programs, dtype=torch.int32, device=device)
        self.count = torch.zeros(1, dtype=torch.int32, device=device)

    def __call__(self, logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if logits.shape != (1, self.vocab_size) or logits.stride(1) != 1:
            raise ValueError(f"GreedyRow: logits must be [1, {self.vocab_size}] and contiguous, got {tuple(logits.shape)}")
        launch(_greedy_row_kernel, (self.programs,), logits, self.part_val, self.part_idx, self.count, out,
               self.vocab_size, BLOCK=GREEDY_BLOCK, PARTS=triton.next_power_of_2(self.programs), num_warps=4)
        return out


# A batch of greedy rows under grammar masks (MaskedGreedy): each row's vocabulary in chunks of
# whole MASKED_GREEDY_BLOCK tiles, one program each.
MASKED_GREEDY_BLOCK = 2048


@triton.jit(do_not_specialize=("chunk", "num_splits"))
def _masked_greedy_kernel(logits_ptr, stride_row, vocab_size, chunk, num_splits, words_ptr, words_stride, row_of_ptr,
                          part_val_ptr, part_idx_ptr, count_ptr, out_ptr, BLOCK: tl.constexpr, PARTS: tl.constexpr):
    """Program (row, split) scans columns [split * chunk, (split + 1) * chunk) of its row, the
    columns its mask row (row_of_ptr[row]; -1: none) allows, keeping each lane's best (value,
    lowest column); it stores the chunk's best and counts itself in, and the last program of
    the row to arrive (acq_rel count) picks the row's best chunk, lowest column on ties, and
    puts the row's count back to 0 for the next launch. A row whose allowed logits are all
    -inf gets its lowest allowed column; a row that allows nothing, 0 (torch.argmax of a row
    of -inf)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    mask_row = tl.load(row_of_ptr + row)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    row_words = words_ptr + tl.maximum(mask_row, 0).to(tl.int64) * words_stride
    offs = tl.arange(0, BLOCK)
    best_val = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = tl.full((BLOCK,), 2**31 - 1, tl.int32)
    lo = split * chunk
    hi = tl.minimum(vocab_size, lo + chunk)
    for start in range(lo, hi, BLOCK):
        cols = start + offs
        valid = mask_allows(row_words, mask_row, cols, cols < hi)
        x = tl.load(row_ptr + cols, mask=valid, other=float("-inf")).to(tl.float32)
        # Each lane sees its columns in increasing order: strictly better, or the first allowed
        # column while the lane has none (an allowed -inf).
        better = valid & ((x > best_val) | (best_idx == 2**31 - 1))
        best_val = tl.where(better, x, best_val)
        best_idx = tl.where(better, cols, best_idx)
    top = tl.max(best_val, axis=0)
    top_idx = tl.min(tl.where(best_val == top, best_idx, 2**31 - 1), axis=0)
    parts = row * PARTS
    tl.store(part_val_ptr + parts + split, top)
    tl.store(part_idx_ptr + parts + split, top_idx)
    arrived = tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == num_splits - 1:
        best = best_part(part_val_ptr + parts, part_idx_ptr + parts, num_splits, PARTS)
        tl.store(out_ptr + row, tl.where(best == 2**31 - 1, 0, best).to(tl.int64))
        tl.store(count_ptr + row, 0)


class MaskedGreedy:
    """`masked_greedy(logits [B, V], words, row_of) -> [B] int64`: each row's argmax among the
    tokens its grammar mask allows (structured/bitmask.py TokenBitmask: words int32 [R, W], bit
    t of a row set = token t allowed; row_of int32 [B], the row of words each batch row reads,
    -1 for a row without a grammar), the lowest token id on ties: what setting the disallowed
    logits to -inf and torch.argmax give (a NaN logit is never picked, where torch.argmax would
    pick it). One launch for the batch, in place of the reference's copy, masking and argmax
    (and of gumbel_argmax's two launches): each row's vocabulary is cut into chunks as there
    (choose_num_splits), and the last of a row's programs to finish picks its best chunk. The
    workspace (each program's best, one arrival count a row that the last program resets) lives
    here and grows with the batch, so one instance serves one stream of launches at a time."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.num_sms = sm_count(self.device)
        self._rows = 0
        self.part_val = self.part_idx = self.count = None

    def _workspace(self, rows: int) -> None:
        if rows > self._rows:
            self._rows = max(rows, 64, 2 * self._rows)
            self.part_val = torch.empty((self._rows, MAX_SPLITS), dtype=torch.float32, device=self.device)
            self.part_idx = torch.empty((self._rows, MAX_SPLITS), dtype=torch.int32, device=self.device)
            self.count = torch.zeros(self._rows, dtype=torch.int32, device=self.device)

    def __call__(self, logits: torch.Tensor, words: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
        if logits.dim() != 2 or logits.stride(1) != 1:
            raise ValueError(f"MaskedGreedy: logits must be [B, V] with contiguous rows, got {tuple(logits.shape)}")
        rows, vocab = logits.shape
        check_mask("MaskedGreedy", words, row_of, rows, vocab)
        if rows * triton.cdiv(vocab, MASKED_GREEDY_BLOCK) * MASKED_GREEDY_BLOCK >= 2**31:
            raise ValueError(f"MaskedGreedy: {rows} rows x {vocab} columns overflow the kernel's 32-bit indices")
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
        if not rows:
            return out
        self._workspace(rows)
        num_splits = choose_num_splits(rows, vocab, self.num_sms)
        chunk = triton.cdiv(triton.cdiv(vocab, num_splits), MASKED_GREEDY_BLOCK) * MASKED_GREEDY_BLOCK
        launch(_masked_greedy_kernel, (rows, num_splits), logits, logits.stride(0), vocab, chunk, num_splits,
               words, words.stride(0), row_of, self.part_val, self.part_idx, self.count, out,
               BLOCK=MASKED_GREEDY_BLOCK, PARTS=MAX_SPLITS, num_warps=8)
        return out
