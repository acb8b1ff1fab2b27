"""Rotary position embedding (GPT-NeoX / Hugging Face "rotate_half" layout).

cos/sin are precomputed once for every position up to `max_position_embeddings` and gathered by
`positions`, so a forward is one index plus a few elementwise ops, the same for prefill chunks
and decodes. Numerics follow Hugging Face: inverse frequencies and the angle table are fp32,
cos/sin are cast to the activation dtype before being applied, and the rotation uses the same
products and sums as `q * cos + rotate_half(q) * sin`.

Config reading accepts both generations of transformers: v5 puts everything in the
`config.rope_parameters` dict; v4 has `config.rope_theta` and an optional `config.rope_scaling`
dict (whose type key is "rope_type", or "type" in older files). Supported scaling: none /
"default"; "linear" (positions interpolated by `factor`); "llama3" (Llama 3.1's
frequency-dependent interpolation); "yarn" (YaRN, what Qwen2.5 and Qwen3 configs name for
contexts past their 32K: frequencies blended between interpolation and extrapolation, and
cos/sin scaled by an attention factor, baked into the table so every kernel that reads it gets
it). Each follows Hugging Face's formulas (tests compare them with transformers'). Anything else
("dynamic", whose frequencies change with the sequence length, "longrope", ...) raises, rather
than silently producing a model that degrades past the original context.

The model's attention block calls `apply_qk_norm_rope`, which also applies Qwen3's per-head q/k
RMSNorm: with fused ops on (CUDA tensors, `fused=True`), norm and rotary for q and k are one
Triton launch that rewrites the q/k slices of the packed qkv output in place (layers/fused.py),
instead of ~25 elementwise kernels. The torch code here stays the reference, for CPU and for fused ops turned off.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nanovllm.layers.norm import RMSNorm

if TYPE_CHECKING:
    from nanovllm.attention.metadata import KVCacheWrite

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config: Any) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict with at least "rope_type") from a v4- or v5-style HF config."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        scaling = dict(params)
        theta = scaling.get("rope_theta", getattr(config, "rope_theta", None))
    else:
        scaling = dict(getattr(config, "rope_scaling", None) or {})
        theta = getattr(config, "rope_theta", None)
    scaling["rope_type"] = scaling.get("rope_type", scaling.get("type")) or "default"
    return float(theta if theta is not None else 10000.0), scaling


def _default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta ** exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    try:
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
    except KeyError as exc:
        raise ValueError(f"llama3 rope scaling is missing {exc.args[0]!r} (got {scaling})") from None
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def _scaling_value(scaling: dict[str, Any], key: str, rope_type: str) -> float:
    try:
        return float(scaling[key])
    except KeyError:
        raise ValueError(f"{rope_type} rope scaling is missing {key!r} (got {scaling})") from None


def _yarn_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): frequencies that turn fewer than `beta_slow` times over the
    original context are interpolated (divided by `factor`), those that turn more than
    `beta_fast` times are kept, with a linear ramp between; cos/sin get an attention factor
    (0.1 ln(factor) + 1 unless the config gives one, or mscale / mscale_all_dim)."""
    original = scaling.get("original_max_position_embeddings") or max_position
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else max_position / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of one step
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: interpolate it
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    """(fp32 inverse frequencies [head_dim // 2], factor applied to cos and sin) for the given
    rope type. max_position, the positions the table covers, stands in for the model's context
    where a YaRN config lacks its original context or its factor (build_rotary fills in the
    original context from max_position_embeddings first)."""
    partial = scaling.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1.0):
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only full rotary)")
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, max_position)
    inv_freq = _default_inv_freq(head_dim, theta)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / _scaling_value(scaling, "factor", rope_type), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float = 10000.0,
        scaling: dict[str, Any] | None = None,
        fused: bool = False,
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        inv_freq, attention_factor = rope_frequencies(head_dim, theta, scaling or {}, max_position)
        angles = torch.arange(max_position, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        # [max_position, head_dim] = [cos | sin], each over head_dim // 2 frequencies, fp32, times
        # YaRN's attention factor (1 otherwise), as HF scales them before casting.
        cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
        if attention_factor != 1.0:
            cos_sin = cos_sin * attention_factor
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)
        # Device types whose tensors take the Triton kernel; tests add "cpu" to run it interpreted.
        self.fused_devices: tuple[str, ...] = ("cuda",) if fused else ()
        # The last CPU step's (positions, dtype, cos, sin): see cos_sin.
        self._last: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def is_fused_for(self, positions: torch.Tensor) -> bool:
        """Whether apply_qk_norm_rope takes the fused Triton kernel for tensors on this device."""
        return positions.device.type in self.fused_devices

    def _rotate(self, x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
        """rotate_halves on q or k as given ([T, H * D] or [T, H, D])."""
        shape = x.shape
        x = x.unflatten(-1, (-1, self.head_dim)) if x.dim() == 2 else x  # [T, H, D], also for T = 0
        return rotate_halves(x, cos2, sin2).view(shape)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[cos, cos] and [-sin, sin] of `positions` ([T, 1, D] each) in `dtype` (rotate_halves's
        factors). On the CPU the last call's are reused while the positions are equal: every
        layer of a forward asks for the same ones, and gathering and casting them costs ~8 small
        ops, each its dispatch on the CPU. Not on CUDA, where this path may run under graph
        capture (which must record every op, and where comparing positions would sync)."""
        last = self._last
        if positions.is_cpu and last is not None and last[1] == dtype and torch.equal(last[0], positions):
            return last[2], last[3]
        cos, sin = self.cos_sin_cache[positions].unsqueeze(-2).to(dtype).chunk(2, dim=-1)
        cos2, sin2 = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        if positions.is_cpu:
            self._last = (positions.clone(), dtype, cos2, sin2)
        return cos2, sin2

    def rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch reference: positions [T]; q, k [T, heads * head_dim] or [T, heads, head_dim]
        (one dtype) -> new tensors of the same shapes."""
        if q.dtype != k.dtype:
            raise ValueError(f"rotary: q is {q.dtype} but k is {k.dtype}")
        cos2, sin2 = self.cos_sin(positions, q.dtype)
        return self._rotate(q, cos2, sin2), self._rotate(k, cos2, sin2)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary alone (no q/k norm); see apply_qk_norm_rope."""
        return apply_qk_norm_rope(self, positions, q, k)


def rotate_halves(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated: halves x1, x2 -> (x1 cos - x2 sin, x2 cos + x1 sin), written as
    x * [cos, cos] + [x2, x1] * [-sin, sin] (RotaryEmbedding.cos_sin's factors), the same products
    and sums (a negated product is rounded as the product is), in four ops instead of seven."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos2 + torch.cat((x2, x1), dim=-1) * sin2


def apply_qk_norm_rope(
    rotary_emb: RotaryEmbedding,
    positions: torch.Tensor,  # [T]
    q: torch.Tensor,  # [T, Hq * D] or [T, Hq, D], e.g. a column slice of the packed qkv output
    k: torch.Tensor,  # [T, Hk * D] or [T, Hk, D]
    q_norm: RMSNorm | None = None,
    k_norm: RMSNorm | None = None,
    kv_write: KVCacheWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k (Qwen3; skipped when the norms are None), then rotary.

    Where fused ops run (`rotary_emb.is_fused_for(positions)`), q and k are rewritten in place by
    one Triton launch and returned as they were given; otherwise the torch reference returns new
    tensors ([T, H, D] after a norm). Either way, use the returned pair. kv_write (fused path
    only) makes the same launch store the rotated K and the V rows into the paged cache.
    """
    if (q_norm is None) != (k_norm is None):
        raise ValueError("apply_qk_norm_rope: pass both q_norm and k_norm, or neither")
    if rotary_emb.is_fused_for(positions):
        from nanovllm.layers.fused import qk_norm_rope  # triton is optional; imported only where it runs

        cache = rotary_emb.cos_sin_cache
        if q_norm is None:
            return qk_norm_rope(q, k, positions, cache, None, None, 0.0, kv_write)
        if q_norm.eps != k_norm.eps:
            raise ValueError(f"apply_qk_norm_rope: q_norm eps {q_norm.eps} != k_norm eps {k_norm.eps}")
        return qk_norm_rope(q, k, positions, cache, q_norm.weight, k_norm.weight, q_norm.eps, kv_write)
    if kv_write is not None:
        raise ValueError("apply_qk_norm_rope: kv_write needs the fused kernel (fused ops on this device)")
    if q_norm is not None:
        as_heads = (-1, rotary_emb.head_dim)  # [T, H * D] -> [T, H, D]; [T, H, D] is left as is
        q = q_norm(q.unflatten(-1, as_heads) if q.dim() == 2 else q)
        k = k_norm(k.unflatten(-1, as_heads) if k.dim() == 2 else k)
    return rotary_emb.rotate(positions, q, k)


def context_length(config: Any) -> int:
    """The longest context the config's positions reach: `max_position_embeddings`, or where rope
    scaling extends it, the extended length, as vLLM derives it: YaRN's original context times
    `factor` (Qwen2.5 / Qwen3 configs keep max_position_embeddings at the original ~32-40K),
    linear scaling's max_position_embeddings times `factor`. Llama 3 configs already give
    their extended length."""
    base = int(config.max_position_embeddings)
    _, scaling = rope_parameters(config)
    rope_type = scaling["rope_type"]
    if rope_type == "yarn" and scaling.get("factor") is not None:
        original = scaling.get("original_max_position_embeddings") or base
        return max(base, int(original * float(scaling["factor"])))
    if rope_type == "linear" and scaling.get("factor") is not None:
        return max(base, int(base * float(scaling["factor"])))
    return base


def build_rotary(config: Any, head_dim: int, fused: bool = False) -> RotaryEmbedding:
    """The rotary embedding a HF decoder config asks for (theta and scaling read as above), with
    a cos/sin table for every position up to context_length(config)."""
    theta, scaling = rope_parameters(config)
    if scaling["rope_type"] == "yarn":  # its original context defaults to the config's, not the table's
        scaling.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return RotaryEmbedding(head_dim, context_length(config), theta, scaling, fused=fused)
