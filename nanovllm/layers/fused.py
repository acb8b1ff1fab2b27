"""Fused Triton kernels for the decoder's small ops: RMSNorm (with the residual add), per-head q/k
RMSNorm plus rotary (which can also store the step's K/V rows into the paged cache, saving the
attention backend's store launch per layer), and SiLU-and-mul.

Why: in eager PyTorch each of these is a chain of elementwise kernels (an RMSNorm is ~7, rotary
~10). At decode sizes every kernel costs its ~2-3 µs launch, not its bytes, so a 28-layer model
spent most of a CUDA-graph decode step launching ~1,500 tiny kernels. Here each op is one launch.

Numerics reproduce the torch reference in norm.py / rotary.py / activation.py (which follow
Hugging Face) step by step: every intermediate the reference rounds to the activation dtype is
rounded here too (the residual sum, the normalised value, each rotary product and sum, the SiLU
output), and everything in between is fp32. Products and sums of two bf16/fp16 values formed in
fp32 and then rounded are exactly what torch's CUDA kernels compute, so the only differences left
are the order of the fp32 variance sum and the transcendental approximations: results agree to
within one unit in the last place of the activation dtype, and are usually bit-identical. FMA
contraction is turned off so fp32 activations are not fused differently from torch either.

Every wrapper is one launch with a grid computed from shapes only (no host sync), so it can be
captured in a CUDA graph; zero tokens launch nothing. Inputs may be row-strided views (q and k are
slices of the packed qkv projection); only the last axis must be contiguous. The model picks
these or the torch path per module (`fused_devices`), see llama.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.attention.metadata import KVCacheWrite
from nanovllm.precompile import launch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_dtype(op: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{op}: unsupported dtype {t.dtype}; expected float32, float16 or bfloat16")


def _rows(op: str, t: torch.Tensor, width: int) -> torch.Tensor:
    """t as [rows, width] with a contiguous last axis (a view when the layout allows)."""
    if t.shape[-1] != width:
        raise ValueError(f"{op}: last dimension {t.shape[-1]} != {width}")
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _row_warps(block: int) -> int:
    return min(16, max(1, block // 256))


# ---- RMSNorm ---------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    N,
    inv_n,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) * inv_n  # torch's mean multiplies by 1/N too
    normed = (xf * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rms_norm(
    op: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    _check_dtype(op, x)
    _check_dtype(op, weight)
    hidden = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != hidden:
        raise ValueError(f"{op}: weight {tuple(weight.shape)} does not match hidden size {hidden}")
    x2 = _rows(op, x, hidden)
    # The reference multiplies by the weight in torch's promoted dtype (the activation dtype when
    # the weight has it, as in the model).
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res2 = None
    if residual is not None:
        if residual.dtype != x.dtype or residual.shape != x.shape:
            raise ValueError(
                f"{op}: residual {tuple(residual.shape)} {residual.dtype} does not match x {tuple(x.shape)} {x.dtype}"
            )
        res2 = _rows(op, residual, hidden)
    if x2.shape[0]:
        block = triton.next_power_of_2(hidden)
        launch(
            _rms_norm_kernel, (x2.shape[0],),
            x2,
            res2 if res2 is not None else x2,
            weight.contiguous(),
            out,
            x2.stride(0),
            res2.stride(0) if res2 is not None else 0,
            out.stride(0),
            hidden,
            1.0 / hidden,
            eps,
            HAS_RESIDUAL=res2 is not None,
            BLOCK=block,
            num_warps=_row_warps(block),
            enable_fp_fusion=False,
        )
    out = out.view(x.shape)
    if residual is None:
        return out
    return out, res2.view(residual.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis: [..., N] -> [..., N] (a new tensor)."""
    return _rms_norm("rms_norm", x, None, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to the activation dtype.

    The sum is written into `residual` in place when its layout allows (always, for the model's
    contiguous residual stream) and returned; callers must use the returned tensor either way.
    """
    return _rms_norm("fused_add_rms_norm", x, residual, weight, eps)


# ---- per-head q/k RMSNorm + rotary -----------------------------------------------------------


@triton.jit
def _norm_rope_heads(
    ptr,
    stride_h,
    w_ptr,
    cos,
    sin,
    eps,
    dst_ptr,
    dst_stride_h,
    dst_slot,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    STORE: tl.constexpr,
):
    """In place on one token's [NUM_HEADS, 2 * HALF] rows at `ptr`: optional RMSNorm per head,
    then neox rotary (first half pairs with second half). cos, sin: [BLOCK_HALF] fp32 values
    already rounded to the activation dtype, as the reference rounds them. With STORE, the result
    is also written (cast to the destination's dtype) to the rows at `dst_ptr` unless `dst_slot`
    is negative (a padding token)."""
    dtype = ptr.dtype.element_ty
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    ptr1 = ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        variance = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) * (1.0 / (2 * HALF))
        scale = tl.rsqrt(variance + eps)[:, None]
        w1 = tl.load(w_ptr + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1 * scale).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * scale).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    # x1 * cos - x2 * sin and x2 * cos + x1 * sin, each product rounded as in the reference.
    o1 = ((x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)).to(dtype)
    tl.store(ptr1, o1, mask=mask)
    tl.store(ptr1 + HALF, o2, mask=mask)
    if STORE:
        dst_mask = mask & ((offs_h * 0 + dst_slot) >= 0)[:, None]
        dst1 = dst_ptr + offs_h[:, None] * dst_stride_h + offs_d[None, :]
        tl.store(dst1, o1.to(dst_ptr.dtype.element_ty), mask=dst_mask)
        tl.store(dst1 + HALF, o2.to(dst_ptr.dtype.element_ty), mask=dst_mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cache_ptr,
    qw_ptr,
    kw_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache,
    stride_kvb,
    stride_kvs,
    stride_kvh,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    STORE: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    dtype = q_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    row = cache_ptr + pos * stride_cache + offs_d
    cos = tl.load(row, mask=offs_d < HALF, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(row + HALF, mask=offs_d < HALF, other=0.0).to(dtype).to(tl.float32)
    _norm_rope_heads(
        q_ptr + token * stride_qt, stride_qh, qw_ptr, cos, sin, eps, q_ptr, 0, -1,
        NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF, HAS_NORM, False,
    )
    if STORE:
        # Paged-cache slot of this token (-1: padding, write nothing): the K row gets the rotated
        # k, the V row a copy of v, as attention/kernels/store_kv.py would write them.
        slot = tl.load(slot_ptr + token).to(tl.int64)
        safe = tl.maximum(slot, 0)
        kv_row = (safe // KV_BLOCK_SIZE) * stride_kvb + (safe % KV_BLOCK_SIZE) * stride_kvs
        _norm_rope_heads(
            k_ptr + token * stride_kt, stride_kh, kw_ptr, cos, sin, eps, k_cache_ptr + kv_row, stride_kvh, slot,
            NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF, HAS_NORM, True,
        )
        offs_h = tl.arange(0, BLOCK_KH)
        mask = (offs_h[:, None] < NUM_K_HEADS) & (offs_d[None, :] < HALF) & ((offs_h * 0 + slot) >= 0)[:, None]
        v_src = v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
        v_dst = v_cache_ptr + kv_row + offs_h[:, None] * stride_kvh + offs_d[None, :]
        for half in tl.static_range(2):
            v = tl.load(v_src + half * HALF, mask=mask, other=0.0)
            tl.store(v_dst + half * HALF, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
    else:
        _norm_rope_heads(
            k_ptr + token * stride_kt, stride_kh, kw_ptr, cos, sin, eps, k_ptr, 0, -1,
            NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF, HAS_NORM, False,
        )


def _heads(name: str, t: torch.Tensor, head_dim: int) -> tuple[int, int, int]:
    """(num_heads, token stride, head stride) of a [T, H * D] or [T, H, D] tensor, in place."""
    if t.stride(-1) != 1:
        raise ValueError(f"qk_norm_rope: {name} must have a contiguous last axis (it is updated in place)")
    if t.dim() == 3 and t.shape[2] == head_dim:
        return t.shape[1], t.stride(0), t.stride(1)
    if t.dim() == 2 and t.shape[1] % head_dim == 0:
        return t.shape[1] // head_dim, t.stride(0), head_dim
    raise ValueError(f"qk_norm_rope: {name} {tuple(t.shape)} is not [T, H * {head_dim}] or [T, H, {head_dim}]")


def qk_norm_rope(
    q: torch.Tensor,  # [T, Hq * D] or [T, Hq, D], updated in place
    k: torch.Tensor,  # [T, Hk * D] or [T, Hk, D], updated in place
    positions: torch.Tensor,  # [T] int
    cos_sin_cache: torch.Tensor,  # [max_position, D] = [cos | sin]
    q_weight: torch.Tensor | None,  # [D]; None (with k_weight None) for models without q/k norm
    k_weight: torch.Tensor | None,
    eps: float,
    kv_write: KVCacheWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm (when weights are given) then neox rotary on q and k, in place, in one
    launch; returns (q, k). Positions must lie in [0, max_position): they are not checked on the
    host, which would need a sync.

    kv_write: also store the step's K (after rotary) and V rows into the paged caches in the same
    launch, exactly as `attention.kernels.store_kv.store_kv` would (slot -1 writes nothing), so
    the attention backend can skip its own store launch."""
    _check_dtype("qk_norm_rope", q)
    if k.dtype != q.dtype:
        raise ValueError(f"qk_norm_rope: q is {q.dtype} but k is {k.dtype}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope: pass both q_weight and k_weight, or neither")
    head_dim = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or head_dim % 2 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("qk_norm_rope: cos_sin_cache must be a contiguous [max_position, head_dim] table")
    num_q, stride_qt, stride_qh = _heads("q", q, head_dim)
    num_k, stride_kt, stride_kh = _heads("k", k, head_dim)
    num_tokens = q.shape[0]
    if k.shape[0] != num_tokens or positions.dim() != 1 or positions.shape[0] != num_tokens:
        raise ValueError(
            f"qk_norm_rope: q {tuple(q.shape)}, k {tuple(k.shape)} and positions {tuple(positions.shape)} "
            "disagree on the number of tokens"
        )
    has_norm = q_weight is not None
    if has_norm:
        for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
            if w.shape != (head_dim,) or w.dtype != q.dtype:
                raise ValueError(
                    f"qk_norm_rope: {name} {tuple(w.shape)} {w.dtype} must be [{head_dim}] in the activation "
                    f"dtype {q.dtype} (the result is written back in place)"
                )
    if kv_write is not None:
        v, stride_vt, stride_vh, k_cache, v_cache, slots = _check_kv_write(kv_write, num_k, head_dim, num_tokens)
    if num_tokens == 0:
        return q, k
    half = head_dim // 2
    block_qh, block_kh = triton.next_power_of_2(num_q), triton.next_power_of_2(num_k)
    block_half = triton.next_power_of_2(half)
    if kv_write is None:  # placeholders: the STORE=False variant never reads them
        v, stride_vt, stride_vh, k_cache, v_cache, slots = k, 0, 0, k, k, positions
        cache_strides, kv_block_size = (0, 0, 0), 1
    else:
        cache_strides, kv_block_size = k_cache.stride()[:3], k_cache.shape[1]
    launch(
        _qk_norm_rope_kernel, (num_tokens,),
        q,
        k,
        positions.contiguous(),
        cos_sin_cache,
        q_weight.contiguous() if has_norm else q,
        k_weight.contiguous() if has_norm else k,
        v,
        k_cache,
        v_cache,
        slots,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        cos_sin_cache.stride(0),
        *cache_strides,
        eps,
        NUM_Q_HEADS=num_q,
        NUM_K_HEADS=num_k,
        HALF=half,
        BLOCK_QH=block_qh,
        BLOCK_KH=block_kh,
        BLOCK_HALF=block_half,
        HAS_NORM=has_norm,
        STORE=kv_write is not None,
        KV_BLOCK_SIZE=kv_block_size,
        num_warps=_row_warps(2 * block_qh * block_half),
        enable_fp_fusion=False,
    )
    return q, k


def _check_kv_write(kv_write: KVCacheWrite, num_k: int, head_dim: int, num_tokens: int):
    """(v, its token and head strides, k_cache, v_cache, slots) of a valid cache write."""
    v, k_cache, v_cache, slots = kv_write
    num_v, stride_vt, stride_vh = _heads("v", v, head_dim)
    if num_v != num_k or v.shape[0] != num_tokens:
        raise ValueError(f"qk_norm_rope: v {tuple(v.shape)} does not match k's {num_tokens} tokens x {num_k} heads")
    want = (num_k, head_dim)
    if k_cache.dim() != 4 or k_cache.shape[2:] != want or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"qk_norm_rope: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} are not "
            f"[blocks, block_size, {num_k}, {head_dim}]"
        )
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("qk_norm_rope: the K and V caches must share one layout with a contiguous head_dim axis")
    if slots.dim() != 1 or slots.shape[0] < num_tokens:
        raise ValueError(f"qk_norm_rope: slot_mapping has {tuple(slots.shape)} entries for {num_tokens} tokens")
    return v, stride_vt, stride_vh, k_cache, v_cache, slots


# ---- SiLU and mul ----------------------------------------------------------------------------


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + offs, mask=mask, other=0.0).to(tl.float32)
    silu = tl.math.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype)
    tl.store(out_ptr + row * stride_o + offs, (silu.to(tl.float32) * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] laid out [gate | up] -> silu(gate) * up, [..., I] (a new tensor)."""
    _check_dtype("silu_and_mul", x)
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dimension {x.shape[-1]} is odd")
    inter = x.shape[-1] // 2
    x2 = _rows("silu_and_mul", x, 2 * inter)
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] and inter:
        block = min(1024, triton.next_power_of_2(inter))
        launch(
            _silu_and_mul_kernel, (x2.shape[0], triton.cdiv(inter, block)),
            x2, out, x2.stride(0), out.stride(0), inter,
            BLOCK=block, num_warps=_row_warps(block), enable_fp_fusion=False,
        )
    return out.view(*x.shape[:-1], inter)
