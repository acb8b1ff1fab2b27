"""Decode steps on the CPU as compiled code: `LLM(..., cpu_compile=True)`.

Why: decoding on the CPU, a lone sequence above all, is bound by dispatch more than arithmetic:
the eager model makes some fifty operator calls per layer, each a few microseconds of Python
and torch overhead, around four matmuls that take about as long together for one row. Compiled
ahead of time, a decoder layer is one call into generated C++ that runs a handful of fused
kernels around the matmuls and the attention (docs/benchmarks.md has the figures).

How: `_DecodeLayer` runs one decoder layer (`_decode_layer`) over plain tensors: the layer's
weights, its K and V caches (views of the KV pool [blocks, 2 x layers, block_size, kv_heads,
head_dim], runner/host_memory.py), the step's block ids. The attention (`_attend`) is written as
products and sums, so the compiled code reads each sequence's cached rows where they lie in the
pool instead of gathering a copy of its context. The layer is exported (torch.export) and
compiled by AOTInductor into a package for one token per sequence, any context length (the
step's block count is a dynamic dimension) and any pool size, in three variants: one row; any
number of rows; and, where the int4 weights have dense bf16 copies (int4_linear.py), any number
of rows over those copies, which serves steps of int4_linear.DENSE_MIN_ROWS sequences or more
(as in the eager layers, the copies multiply a large batch faster than the codes). A step calls
the package once per layer: every layer has the same shapes, so one package of a layer serves
the whole depth, and its build takes seconds (a layer is a thirtieth of a small model). The weights
and caches are inputs, not constants: one package serves every layer and every checkpoint of a
shape; the step passes each layer's inputs to the package's loader already flattened. The
runner builds or loads every variant at start-up (one dummy step each, `variant_rows`), so no
request waits for a build. Each package is built once and kept in the user's cache directory
(loaders/cache.py), keyed by the layer's shapes, torch's version and this file, so a later
process loads it in about a second (the three variants). Inductor rounds as eager torch does
(`emulate_precision_casts`). The new K and V rows come back from each layer, and the step stores
them together after the last.

Where the int4 mode's int8 LM head has no FBGEMM (layers/int8_head.py), a lone row's head runs
compiled too (`_int8_head`, torch.compile).

What it covers: the Llama-family dense decoders (Llama, SmolLM2, Qwen2, Qwen3) with fp32, bf16
or int4 weights, one rank. Prompts run through the eager model, which stays the reference
(tests/test_cpu_compiled_decode.py compares the two); in a step that has both, the runner sends
the decoding sequences here and the prompts' tokens to the eager model
(attention/metadata.split_decodes).
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch._inductor
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.layers.int4_linear import DENSE_MIN_ROWS, Int4Weight
from nanovllm.layers.norm import weighted_rms_norm
from nanovllm.layers.rotary import rotate_halves

logger = logging.getLogger("nanovllm")

# Inductor's options: round every intermediate as eager torch would (bf16 models); and keep a
# pointwise result of more than 24 operations in a buffer where several kernels read it, rather
# than recompute it there: the attention's scores would otherwise redo each query's rotation at
# every cached position. (At 8, the product of the query and a cached row read through the block
# table lands in a buffer too, written and read back in full, instead of being summed as it is made.)
COMPILE_OPTIONS = {"emulate_precision_casts": True, "realize_opcount_threshold": 24}


def unsupported_reason(model: nn.Module) -> str | None:
    """Why `model` cannot decode through the compiled layer, or None."""
    if not hasattr(torch._inductor, "aoti_compile_and_package"):
        return f"torch {torch.__version__} has no AOTInductor packages (torch 2.6 or later has them)"
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None or not len(layers):
        return "not a Llama-family decoder"
    for layer in layers:
        if getattr(layer, "mlp_reads_metadata", False) or not hasattr(layer.mlp, "gate_up_proj"):
            return "a mixture-of-experts layer"
    if len({repr(_describe(_layer_weights(layer, dense=False))) for layer in layers}) > 1:
        return "its layers differ in shape (one package serves every layer)"
    return None


def chosen_automatically(model: nn.Module, tensor_parallel_size: int) -> bool:
    """Whether a CPU engine left to choose (cpu_compile=None) decodes compiled: where it runs on
    one rank, this module covers the model, and Inductor finds a C++ compiler to build with."""
    if tensor_parallel_size != 1:
        return False
    reason = unsupported_reason(model)
    if reason is not None:
        logger.info("cpu_compile: this model decodes with the eager model (%s)", reason)
        return False
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - no compiler (or an Inductor without the lookup): eager
        logger.info("cpu_compile: no C++ compiler found (%s); decoding with the eager model", e)
        return False
    return True


def _weight(linear: nn.Module, dense: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, int]:
    """A projection's weight as `_linear` takes it: a dense tensor (an int4 weight's dense bf16
    copy where `dense`), or an int4 weight's (packed codes, scales and zeros, group size)."""
    w = linear.weight
    if isinstance(w, Int4Weight):
        return w.dense if dense else (w.packed, w.scales_and_zeros, w.group_size)
    return w


def _layer_weights(layer: nn.Module, dense: bool) -> tuple:
    """A decoder layer's weights as `_decode_layer` takes them (`_weight`'s form for the
    projections; None for a bias or a norm the layer lacks)."""
    attn, mlp = layer.self_attn, layer.mlp
    return (
        layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
        _weight(attn.qkv_proj, dense), attn.qkv_proj.bias, _weight(attn.o_proj, dense), attn.o_proj.bias,
        _weight(mlp.gate_up_proj, dense), mlp.gate_up_proj.bias, _weight(mlp.down_proj, dense),
        mlp.down_proj.bias, attn.q_norm.weight if attn.q_norm is not None else None,
        attn.k_norm.weight if attn.k_norm is not None else None,
    )


def _describe(t) -> object:
    """A weight's (or a tuple of them) shapes, strides and dtypes: what compiled code over it
    depends on."""
    if isinstance(t, torch.Tensor):
        return (tuple(t.shape), t.stride(), str(t.dtype))
    if isinstance(t, tuple):
        return tuple(_describe(x) for x in t)
    return t


def _linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(w, tuple):
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w[0], w[2], w[1])
    else:
        y = F.linear(x, w)
    return y if bias is None else y + bias


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_context: torch.Tensor, v_context: torch.Tensor,
            mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of B one-token queries q [B, kv_heads, group, D] (query head h = kv head h //
    group) over their cached context k_context, v_context [B, positions, kv_heads, D], masked by
    `mask` [B, 1, 1, positions] (0 where a row attends, -inf past its context), then over their
    own k, v [B, kv_heads, D]: [B, kv_heads, group, D] in fp32. Written as products and sums, not
    as one attention operator: the compiled code reads the cached rows where they lie in the pool
    (the block table's gather fused into the reductions) instead of copying the context first.
    The scores are computed position by position (each cached row read once, whole) and then
    laid out positions last, so that their max and sum run along a row of their own, in parallel
    over the rows and heads."""
    q = q.float() * scale
    scores = (q[:, None] * k_context.float()[:, :, :, None, :]).sum(-1)  # [B, positions, kv_heads, group]
    scores = scores.permute(0, 2, 3, 1) + mask  # [B, kv_heads, group, positions]
    own = (q * k.float()[:, :, None, :]).sum(-1)  # [B, kv_heads, group]
    top = torch.maximum(scores.amax(-1), own)
    weights, own_weight = torch.exp(scores - top[..., None]), torch.exp(own - top)
    total = weights.sum(-1) + own_weight
    values = v_context.float().permute(0, 2, 1, 3)  # [B, kv_heads, positions, D]
    mixed = (weights[..., None] * values[:, :, None]).sum(3) + own_weight[..., None] * v.float()[:, :, None, :]
    return mixed / total[..., None]


def _decode_layer(
    hidden: torch.Tensor, residual: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, w: tuple,
    k_context: torch.Tensor, v_context: torch.Tensor, mask: torch.Tensor, eps: float,
    heads: int, kv_heads: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer for B sequences decoding one token each (LlamaDecoderLayer's
    arithmetic): (hidden [B, H], residual [B, H]) -> the next layer's pair, and the tokens' K and
    V rows [B, kv_heads, head_dim]. k_context and v_context [B, positions, kv_heads, head_dim] are
    each sequence's cache blocks; row b attends to them under `mask` (`_attend`), then to its own
    K and V."""
    ln1, ln2, qkv, qkv_bias, o, o_bias, gate_up, gate_up_bias, down, down_bias, q_norm, k_norm = w
    rows, head_dim = hidden.shape[0], k_context.shape[-1]
    residual = hidden + residual
    x = weighted_rms_norm(residual, ln1, eps)
    q, k, v = _linear(x, qkv, qkv_bias).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(rows, heads, head_dim), k.view(rows, kv_heads, head_dim), v.view(rows, kv_heads, head_dim)
    if q_norm is not None:
        q, k = weighted_rms_norm(q, q_norm, eps), weighted_rms_norm(k, k_norm, eps)
    q, k = rotate_halves(q, cos2, sin2), rotate_halves(k, cos2, sin2)
    k, v = k.to(k_context.dtype), v.to(v_context.dtype)
    attn = _attend(q.view(rows, kv_heads, heads // kv_heads, head_dim), k, v, k_context, v_context, mask, scale)
    hidden = _linear(attn.view(rows, heads * head_dim).to(q.dtype), o, o_bias)
    residual = hidden + residual
    x = weighted_rms_norm(residual, ln2, eps)
    gate, up = _linear(x, gate_up, gate_up_bias).chunk(2, dim=-1)
    return _linear(F.silu(gate) * up, down, down_bias), residual, k, v


class _DecodeLayer(nn.Module):
    """One decoder layer for B sequences decoding one token each, as the package runs it:
    (hidden [B, H], residual [B, H]) -> the next layer's pair, and the tokens' K and V rows
    [B, kv_heads, head_dim], which the caller stores. k_cache and v_cache [blocks, block_size,
    kv_heads, head_dim] are the layer's caches (views of the pool: every layer's have the same
    shape and strides, so one package serves them all); row b attends to its first context[b]
    cached positions, in the blocks block_ids[b]. The caches are read, not written. The model's
    constants (eps, head counts, scale) are attributes: the exported program holds them."""

    def __init__(self, eps: float, heads: int, kv_heads: int, scale: float) -> None:
        super().__init__()
        self.eps, self.heads, self.kv_heads, self.scale = eps, heads, kv_heads, scale

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor,
                weights: tuple, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
                context: torch.Tensor):
        rows, blocks = hidden.shape[0], block_ids.shape[1]
        _, block_size, kv_heads, head_dim = k_cache.shape
        positions = blocks * block_size
        mask = torch.zeros(rows, positions).masked_fill(torch.arange(positions)[None, :] >= context[:, None],
                                                        float("-inf")).view(rows, 1, 1, positions)
        k_context = k_cache[block_ids].view(rows, positions, kv_heads, head_dim)
        v_context = v_cache[block_ids].view(rows, positions, kv_heads, head_dim)
        return _decode_layer(hidden, residual, cos2, sin2, weights, k_context, v_context, mask,
                             self.eps, self.heads, self.kv_heads, self.scale)


def _int8_head(hidden: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """ParallelLMHead's int8 product (torch's `_weight_int8pack_mm`: hidden . codes per vocabulary
    row, summed in fp32, times the row's scale, rounded to bf16) as one compiled reduction, which
    streams the codes at the memory's pace: [1, H] -> [1, V] fp32 (one row: a lone sequence)."""
    return ((hidden.float().view(1, 1, -1) * codes.float()).sum(-1) * scales.float()).to(scales.dtype).float()


class CompiledCpuDecode:
    """`decode(input_ids [B], positions [B], meta) -> hidden [B, H]` for a step of B sequences
    decoding one token each, through the compiled layer (each variant built or loaded at its
    first step: the runner makes those at start-up, `variant_rows`)."""

    def __init__(self, model: nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"cpu_compile: this model cannot decode compiled ({reason})")
        decoder = model.model
        self.embed_tokens, self.norm = decoder.embed_tokens, decoder.norm
        self.attentions = [layer.self_attn.attn for layer in decoder.layers]
        first = decoder.layers[0].self_attn
        self.rotary_emb = first.rotary_emb
        self.layer = _DecodeLayer(decoder.layers[0].input_layernorm.eps, first.num_heads, first.num_kv_heads,
                                  first.attn.scale)
        # Int4 weights with dense bf16 copies: steps of DENSE_MIN_ROWS rows or more multiply those.
        down = decoder.layers[0].mlp.down_proj.weight
        self.dense_from = DENSE_MIN_ROWS if isinstance(down, Int4Weight) and down.dense is not None else None
        # Each layer's weights as the package takes them, over the codes and (where they exist) the
        # dense copies; and their tensors, the package's weight inputs in order (pytree leaves),
        # flattened once here, not at each step.
        self.weights = {dense: [_layer_weights(layer, dense) for layer in decoder.layers]
                        for dense in ((False, True) if self.dense_from is not None else (False,))}
        self.weight_inputs = {dense: [[t for t in pytree.tree_leaves(w) if isinstance(t, torch.Tensor)] for w in ws]
                              for dense, ws in self.weights.items()}
        self.compiled: dict[tuple[bool, bool], object] = {}  # (batched, dense) -> the loaded AOTInductor package
        self._pool: torch.Tensor | None = None  # pool(), for the caches it was made of (_pool_of)
        self._pool_of: tuple | None = None
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # each layer's (K, V) slot of the pool
        self.lm_head = model.lm_head
        self.head = torch.compile(_int8_head, dynamic=False, options=COMPILE_OPTIONS)

    def variant_rows(self) -> list[int]:
        """A step size for each variant: one row, a batch over the codes (or the dense weights),
        and a batch over the int4 weights' dense copies where they exist."""
        return [1, 2] + ([self.dense_from] if self.dense_from is not None else [])

    def takes(self, num_seqs: int, num_decodes: int, num_tokens: int) -> bool:
        """Whether a step of this shape decodes compiled: every sequence decodes one token."""
        return num_seqs == num_decodes == num_tokens >= 1

    def pool(self) -> torch.Tensor:
        """The KV pool as one tensor [blocks, 2 x layers, block_size, kv_heads, head_dim]: the
        runner's caches are its views (layer i's K cache is slot i, its V cache slot layers + i)."""
        k0, k1 = self.attentions[0].k_cache, self.attentions[1 % len(self.attentions)].k_cache
        layers = len(self.attentions)
        slot = (k1.data_ptr() - k0.data_ptr()) // k0.element_size() if layers > 1 else k0[0].numel()
        for i, attn in enumerate(self.attentions):
            for j, cache in ((i, attn.k_cache), (layers + i, attn.v_cache)):
                if cache.data_ptr() != k0.data_ptr() + j * slot * k0.element_size() or cache.stride() != k0.stride():
                    raise ValueError("cpu_compile: the KV caches are not slots of one pool (runner/host_memory.py)")
        return torch.as_strided(k0, (k0.shape[0], 2 * layers) + tuple(k0.shape[1:]), (k0.stride(0), slot) + k0.stride()[1:])

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = torch.zeros_like(hidden)
        cos2, sin2 = self.rotary_emb.cos_sin(positions, hidden.dtype)
        k0 = self.attentions[0].k_cache
        if self._pool is None or self._pool_of != (k0.data_ptr(), k0.shape):  # the runner's caches, made once
            self._pool, self._pool_of = self.pool(), (k0.data_ptr(), k0.shape)
            layers = len(self.attentions)
            self._caches = [(self._pool[:, i], self._pool[:, layers + i]) for i in range(layers)]
        pool = self._pool
        block_size = pool.shape[2]
        # Two blocks at least: the exported block count is dynamic from 2 (a padding block is
        # masked out like any position past a sequence's context).
        blocks = max(2, -(-(max(meta.seq_lens_cpu) - 1) // block_size))
        table = meta.block_tables
        if table.shape[1] < blocks:
            table = F.pad(table, (0, blocks - table.shape[1]))
        block_ids = table[:, :blocks].long()
        context = meta.seq_lens - 1  # the positions cached before each token
        rows = len(input_ids)
        variant = (rows > 1, self.dense_from is not None and rows >= self.dense_from)
        run = self._compiled(variant, hidden, residual, cos2, sin2, *self._caches[0], block_ids, context).loader.boxed_run
        new_k, new_v = [], []
        for weights, (k_cache, v_cache) in zip(self.weight_inputs[variant[1]], self._caches):
            hidden, residual, k, v = run([hidden, residual, cos2, sin2, *weights, k_cache, v_cache, block_ids, context])
            new_k.append(k)
            new_v.append(v)
        new = torch.stack(new_k + new_v, 1)  # [B, 2 x layers, kv_heads, head_dim]: the pool's slot order
        slot = meta.slot_mapping  # -1: store nothing (a dummy step's rows)
        if len(slot) == 1:
            if int(slot[0]) >= 0:
                pool[int(slot[0]) // block_size, :, int(slot[0]) % block_size] = new[0]
        else:
            if bool((slot < 0).any()):
                slot, new = slot[slot >= 0], new[slot >= 0]
            pool[slot // block_size, :, slot % block_size] = new
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head for `__call__`'s hidden state: for one row, its int8 codes through the
        compiled reduction where the head's int8 kernel is torch's reference one (FBGEMM's is
        faster still), else the head itself."""
        int8 = self.lm_head.int8
        if int8 is None or int8.serves_any_rows or hidden.shape[0] != 1:
            return self.lm_head(hidden)
        return self.head(hidden, int8.codes, int8.scales_bf16)

    def _compiled(self, variant: tuple[bool, bool], *example: torch.Tensor):
        """The loaded package of this variant (an AOTICompiledModel, run through its loader with
        the inputs flattened): from the cache, or exported and compiled now on the first layer's
        inputs in this step (`example`: those but the weights)."""
        run = self.compiled.get(variant)
        if run is None:
            batched, dense = variant
            hidden, residual, cos2, sin2, k_cache, v_cache, block_ids, context = example
            args = (hidden, residual, cos2, sin2, self.weights[dense][0], k_cache, v_cache, block_ids, context)
            run = self.compiled[variant] = aot_package(self.layer, args, batched, self._shape_key(k_cache, dense))
        return run

    def _shape_key(self, k_cache: torch.Tensor, dense: bool) -> str:
        """What the compiled code depends on besides the dynamic sizes: a layer's weights' and
        caches' shapes, strides and dtypes, and the model's constants."""
        s = self.layer
        return repr((_describe(self.weights[dense][0]), k_cache.shape[1:], k_cache.stride(), str(k_cache.dtype),
                     s.eps, s.heads, s.kv_heads, s.scale, self.embed_tokens.weight.dtype))


def aot_package(layer: nn.Module, args: tuple, batched: bool, shape_key: str):
    """The AOTInductor package of `layer` for inputs like `args` (one row, or any number where
    `batched`; any block count from 2 and any pool size), loaded: from the user's cache where a
    process built it before, else exported, compiled and kept there, under a directory for this
    code (torch's version and this module), which drops the directories of other code."""
    from nanovllm.loaders.cache import buffer_digest, cache_dir, cache_enabled, discard, scratch_dir

    code = buffer_digest(repr((torch.__version__, Path(__file__).read_bytes())).encode())
    path = cache_dir() / "cpu-decode" / code / f"{buffer_digest(repr((shape_key, batched)).encode())}.pt2"
    if cache_enabled() and path.exists():
        try:
            return torch._inductor.aoti_load_package(str(path))
        except Exception as e:  # noqa: BLE001 - a damaged entry is rebuilt
            discard(path, e)
    rows = torch.export.Dim("rows", min=2) if batched else None
    blocks = torch.export.Dim("blocks", min=2)
    pool_blocks = torch.export.Dim("pool_blocks", min=2)
    per_row = {0: rows} if batched else None
    dynamic = (per_row, per_row, per_row, per_row, pytree.tree_map(lambda _: None, args[4]), {0: pool_blocks},
               {0: pool_blocks}, {0: rows, 1: blocks} if batched else {1: blocks}, per_row)
    logger.info("cpu_compile: compiling the %s decode layer ahead of time (once per model shape)",
                "batched" if batched else "one-row")
    program = torch.export.export(layer, args, dynamic_shapes=dynamic, strict=False)
    keep = cache_enabled()
    if keep:  # packages of other code (another torch, an older nano-vllm) are not loaded again
        if path.parent.parent.is_dir():
            for other in path.parent.parent.iterdir():
                if other.name != code and not other.name.startswith("."):
                    shutil.rmtree(other, ignore_errors=True)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            writable = os.access(path.parent, os.W_OK)
        except OSError:
            writable = False
        if not writable:  # a read-only cache: build anyway, in a temporary directory
            logger.warning("cpu_compile: the cache %s cannot be written; the build is not kept", path.parent)
            keep = False
    with scratch_dir(path) if keep else tempfile.TemporaryDirectory() as tmp:
        built = torch._inductor.aoti_compile_and_package(program, package_path=str(Path(tmp) / "step.pt2"),
                                                         inductor_configs=COMPILE_OPTIONS)
        if keep:
            os.replace(built, path)  # one rename: readers see the whole package or none
            built = str(path)
        return torch._inductor.aoti_load_package(built)
