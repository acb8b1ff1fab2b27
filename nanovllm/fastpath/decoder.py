"""The host side of the persistent decode kernel: `PersistentDecoder` lays out the model's
weights and KV caches for `_decode_kernel` (kernel.py), picks the kernel's build from what the
GPU and the model allow, and launches it for one decoding sequence."""
from __future__ import annotations

from typing import Any

import torch
import triton

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.fastpath import head_quant
from nanovllm.fastpath.common import _FIELDS, _LOG2E, _NUM_FIELDS, _PROBE_POINTS, _TILE_ELEMENTS, BLOCK_T, SPLIT_TOKENS
from nanovllm.fastpath.kernel import _STAGES_PER_LAYER, _decode_kernel
from nanovllm.fastpath.ptx import MMA_K_STEP, align_up, down_asm, mma_asm, reserve_shared_memory
from nanovllm.layers.fused_sampler import BLOCK_V as GUMBEL_BLOCK
from nanovllm.precompile import compiling_only, launch

# Fixed choices of the kernel's build, each the faster of the ways tried (docs/persistent_kernel.md
# says why each wins):
OWN_TOKEN_SPLIT = True  # one more attention part for the step's own token where that costs no split
ONE_THREAD_BARRIER = True  # thread 0 alone arrives at and polls a grid barrier (ptx.grid_arrive)
KV_PREFETCH_CG = True  # the first cached K/V tile loaded through the L2 only: L1 fills would hold the barrier
ACC_COPIES = 4  # fp32 copies of the down sums (fused_mlp): fewer atomic reductions collide per address
GATE_UP_LATE = True  # gate/up rows copied once the attention parts are stored, off stage A's barrier
O_LATE = True  # the o tile copied once stage A's input is loaded; MULTI_STEP's mbarrier parities assume it
QKV_EARLY_EIGHTHS = 4  # eighths of the next layer's qkv rows copied during the MLP, the rest after its arrival
NUM_WARPS = 8  # per program (one per SM): the rows of the tensor-core and K-split programs are split among them


def _tile_shape(rows: int, k: int, elements: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_K) for a program's slice of `rows` rows over a K of `k`, about `elements`
    weights per chunk."""
    block_r = triton.next_power_of_2(rows)
    return block_r, max(16, min(triton.next_power_of_2(k), elements // block_r))


def unsupported_reason(model: Any) -> str | None:
    """Why `model` cannot take the persistent decode kernel (None: it can)."""
    from nanovllm.distributed import tp_size
    from nanovllm.models.llama import LlamaForCausalLM, LlamaMLP

    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not a Llama-family decoder"
    if tp_size() != 1:
        return "tensor parallelism"
    if not all(isinstance(layer.mlp, LlamaMLP) for layer in model.model.layers):
        return "mixture-of-experts MLP layers"
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    if attn.o_proj.bias is not None or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
        return "o/MLP projection biases"
    if attn.head_dim & (attn.head_dim - 1) or attn.head_dim < 32:
        # Attention multiplies head halves with tl.dot, whose inner dimension is at least 16.
        return f"head_dim {attn.head_dim} is not a power of two >= 32"
    if attn.num_heads % attn.num_kv_heads:
        return "query heads are not a multiple of KV heads"
    dtypes = {p.dtype for p in model.parameters()}
    if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.float16, torch.bfloat16}:
        return f"parameter dtypes {sorted(map(str, dtypes))} (needs one of float32/float16/bfloat16)"
    if attn.q_norm is not None and attn.q_norm.eps != attn.k_norm.eps:
        return "q_norm and k_norm have different eps"
    return None


class PersistentDecoder:
    """`decoder(input_ids [1], positions [1], meta) -> hidden [1, H]` for one decoding sequence:
    the model's forward (final norm included) in one launch, or one launch per stage with
    `persistent=False`. Call `bind` with the KV caches after every (re)allocation. Inputs are
    read from the device tensors given (graph-capturable: no host sync, fixed launch shapes).

    num_programs: one per SM for the persistent launch (every program must be resident). The
    other keywords are shapes: context splits (at most max_splits parts, a power of two, of at
    least split_tokens positions, walked block_t at a time) and weights per register tile;
    the defaults suit the GPUs' SM counts and the models served, and the tests use small ones so
    that programs take several items and contexts several splits. Then the build's stages, each
    on by default where the GPU and the model allow it (None) and turned off where they do not:
    smem_weights (weights through shared-memory slots: see _smem_weights_fit; else straight into
    registers, what models whose slices do not fit take), mma_projections (16-bit weights in the
    slots: projections on tensor cores, mma_asm; else FMAs, what fp32 models take), fused_mlp
    (the MLP in one stage, its down sums in ACC_COPIES fp32 copies), fused_attn (the o projection
    in the attention stage; needs fused_mlp and a program per KV head), fused_head (the LM head
    and the greedy argmax, or a temperature sample, in the kernel, into self.logits and
    next_token), quantized_head (with fused_head: a step that only needs the token picks it from
    an int8 copy of the head, exactly, see head_quant.py; head_candidates, head_scan_rows:
    candidates listed per round and rows per thread in their scan, for tests), multi_step (a
    decode burst in one launch, see __call__). Tests turn each off to compare it with the path
    without it. stage_mask and probe serve benchmarks/persistent_decode.py (see _decode_kernel;
    probe's stamps land in self.probe, with each program's SM)."""

    def __init__(
        self, model: Any, num_programs: int, persistent: bool = True,
        max_splits: int = 16, split_tokens: int = SPLIT_TOKENS, block_t: int = BLOCK_T,
        tile_elements: int = _TILE_ELEMENTS, stage_mask: int = 31, probe: bool = False,
        smem_weights: bool = True, mma_projections: bool = True, fused_mlp: bool | None = None,
        fused_attn: bool | None = None, fused_head: bool | None = None, quantized_head: bool | None = None,
        head_candidates: int | None = None, head_scan_rows: int | None = None, multi_step: bool | None = None,
    ) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"persistent decode does not support this model: {reason}")
        if max_splits < 1 or max_splits & (max_splits - 1):
            raise ValueError(f"max_splits must be a power of two, got {max_splits}")
        if block_t < 16 or block_t & (block_t - 1):
            raise ValueError(f"block_t must be a power of two >= 16 (a tl.dot dimension), got {block_t}")
        inner = model.model
        layer = inner.layers[0]
        attn = layer.self_attn
        self.model = model
        self.persistent = persistent
        self.num_programs = num_programs
        self.num_warps = num_warps = NUM_WARPS
        self.max_splits = max_splits
        self.dtype = inner.embed_tokens.weight.dtype
        device = inner.embed_tokens.weight.device
        self.hidden = inner.embed_tokens.weight.shape[1]
        self.num_q, self.num_k, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.inter = layer.mlp.down_proj.weight.shape[1]
        self.num_layers = len(inner.layers)
        self.eps = float(layer.input_layernorm.eps)
        self.has_norm = attn.q_norm is not None
        self.qk_eps = float(attn.q_norm.eps) if self.has_norm else 0.0
        self.has_bias = attn.qkv_proj.bias is not None
        self.scale = attn.attn.scale
        self.cos_sin = attn.rotary_emb.cos_sin_cache
        n_qkv = (self.num_q + 2 * self.num_k) * self.head_dim
        empty = lambda n, dtype=self.dtype: torch.zeros(n, dtype=dtype, device=device)  # noqa: E731
        self.resid, self.qkv = empty(self.hidden), empty(n_qkv)
        self.attn_out, self.act = empty(self.num_q * self.head_dim), empty(self.inter)
        self.out = empty((1, self.hidden))
        self.acc = empty(ACC_COPIES * self.hidden, torch.float32)
        self.resid2, self.acc_o = empty(self.hidden), empty(self.hidden, torch.float32)  # fused_attn
        self.part_acc = empty(self.num_q * max_splits * self.head_dim, torch.float32)
        self.part_ml = empty(self.num_q * max_splits * 2, torch.float32)
        # fused_attn: a count per layer and KV head; fused_head: the pick's count, the step word and
        # the int8 head's shared bound (_stage_head_q)
        self.sync = empty(4 + self.num_k * self.num_layers, torch.int32)
        # probe: [2 (global ns, SM cycles), layers, PROBE_POINTS, programs] stamps, 0 = not reached
        self.probe = empty(2 * self.num_layers * _PROBE_POINTS * num_programs if probe else 1, torch.int64)
        self.rows_qkv = -(-n_qkv // num_programs)
        self.rows_h = -(-self.hidden // num_programs)
        self.rows_inter = -(-self.inter // num_programs)
        br_qkv, bk_qkv = _tile_shape(self.rows_qkv, self.hidden, tile_elements)
        br_h, bk_o = _tile_shape(self.rows_h, self.num_q * self.head_dim, tile_elements)
        _, bk_down = _tile_shape(self.rows_h, self.inter, tile_elements)
        _, bk_inter = _tile_shape(2 * self.rows_inter, self.hidden, tile_elements)  # a gate and an up tile
        _, bk_dt = _tile_shape(self.rows_inter, self.hidden, tile_elements)  # W_down^T rows (fused_mlp)
        # fused_attn's o items: (KV head, block of rbs rows), num_programs // num_k blocks.
        group_width = self.num_q // self.num_k * self.head_dim
        self.rbs = -(-self.hidden // max(1, num_programs // self.num_k))
        br_ob, bk_ob = _tile_shape(self.rbs, group_width, tile_elements)
        self.constexprs = dict(
            H=self.hidden, NQ=self.num_q, NK=self.num_k, D=self.head_dim, INTER=self.inter,
            SPLIT_MIN=split_tokens, MAX_SPLITS=max_splits, BLOCK_T=block_t, OWN_SPLIT=int(OWN_TOKEN_SPLIT),
            BLOCK_G=max(2, triton.next_power_of_2(self.num_q // self.num_k)),
            HAS_NORM=self.has_norm, HAS_BIAS=self.has_bias,
            BR_QKV=br_qkv, BK_QKV=bk_qkv, BR_H=br_h, BK_H=triton.next_power_of_2(self.hidden) if self.hidden <= 8192 else 8192,
            BK_O=bk_o, BK_DOWN=bk_down, BR_INTER=triton.next_power_of_2(self.rows_inter), BK_INTER=bk_inter,
            ONE_THREAD_BARRIER=ONE_THREAD_BARRIER, STAGE_MASK=stage_mask, PROBE=probe, KV_PREFETCH_CG=KV_PREFETCH_CG,
            BK_DT=bk_dt, THREADS=num_warps * 32,
        )
        self.table: torch.Tensor | None = None
        # Shared-memory weight slots (SMEM_WEIGHTS in _decode_kernel): X holds a program's qkv
        # or gate+up rows, Y its o or down rows; before them, 128 bytes hold the mbarriers and
        # table_bytes a copy of the offset table.
        item = self.dtype.itemsize
        self.table_bytes = align_up(self.num_layers * _NUM_FIELDS * 8, 128)
        self.slot_x_bytes = align_up(max(self.rows_qkv, 2 * self.rows_inter) * self.hidden * item, 128)
        self.slot_y_bytes = align_up(max(max(self.num_q * self.head_dim, self.inter) * self.rows_h,
                                         self.rows_inter * self.hidden, self.rbs * group_width) * item, 128)
        # Tensor-core projections (mma_asm): the input staged at xbuf, the warps' sums at red.
        q, h = self.num_q * self.head_dim, self.hidden
        self.xbuf_bytes = align_up(max(max(h, q, self.inter) * item, self.rows_inter * 4), 128)  # or fused_mlp's act (fp32)
        self.red_rows = max(self.rows_qkv, self.rows_h, 2 * self.rows_inter, self.rbs)  # the most rows of one projection
        red_bytes = align_up(num_warps * (self.red_rows + 1) * 4, 128)
        self.smem_bytes = 128 + self.table_bytes + self.slot_x_bytes + self.slot_y_bytes + self.xbuf_bytes + red_bytes
        self.smem_weights = smem_weights and self._smem_weights_fit(device, [
            (self.hidden, bk_qkv), (self.num_q * self.head_dim, bk_o), (self.inter, bk_down), (self.hidden, bk_inter),
            (self.hidden, bk_dt), (group_width, bk_ob)])
        # The MLP in one stage (FUSED_MLP in _decode_kernel): by default where the weights go
        # through shared memory, the small models a lone sequence's latency is about. It keeps a
        # transposed copy of every layer's down weight (for Qwen3-0.6B, 168 MB).
        self.fused_mlp = self.smem_weights and h % 4 == 0 if fused_mlp is None else fused_mlp
        if self.fused_mlp and self.smem_weights and h % 4:
            raise ValueError(f"fused_mlp through the shared-memory slots needs hidden_size a multiple of 4, got {h}")
        self.down_t = ([lyr.mlp.down_proj.weight.t().contiguous() for lyr in inner.layers] if self.fused_mlp
                       else [None] * self.num_layers)
        if self.fused_mlp:
            self.constexprs.update(ACC_COPIES=ACC_COPIES)
            if self.smem_weights:
                self.constexprs.update(DOWN_ASM=down_asm(self.rows_inter, h, num_warps * 32, self.dtype))
        # The o projection in the attention stage (FUSED_ATTN; needs the one-stage MLP's residual
        # handling and a program per KV head at least). It keeps a copy of every layer's o weight
        # with each KV head's columns together (for Qwen3-0.6B, 112 MB).
        self.fused_attn = (self.fused_mlp and self.smem_weights and num_programs >= self.num_k
                           if fused_attn is None else fused_attn)
        if self.fused_attn and not self.fused_mlp:
            raise ValueError("fused_attn needs fused_mlp")
        if self.fused_attn and num_programs < self.num_k:
            raise ValueError(f"fused_attn needs a program per KV head at least ({self.num_k}), got {num_programs}")
        self.o_perm = ([lyr.self_attn.o_proj.weight.view(h, self.num_k, group_width).permute(1, 0, 2).contiguous()
                        for lyr in inner.layers] if self.fused_attn else [None] * self.num_layers)
        if self.fused_attn:
            self.constexprs.update(FUSED_ATTN=True, RBS=self.rbs, BR_OB=br_ob, BK_OB=bk_ob, GU_LATE=GATE_UP_LATE,
                                   O_LATE=O_LATE, QKV_EARLY=QKV_EARLY_EIGHTHS)
        self._smem_off: int | None = None
        self.mma = (self.smem_weights and mma_projections and self.dtype in (torch.bfloat16, torch.float16)
                    and all(k % MMA_K_STEP == 0 for k in (h, q, self.inter))
                    and max(self.rows_qkv, self.rows_h, self.rows_inter) <= num_warps * 32
                    # the staged inputs are one block each (BK_H stops at 8,192)
                    and h <= 8192 and max(q, self.inter) <= 16384)
        if self.mma:
            self.constexprs.update(
                XBUF_BYTES=self.xbuf_bytes,
                BX_O=triton.next_power_of_2(q), BX_DOWN=triton.next_power_of_2(self.inter),
                MMA_QKV=mma_asm(self.rows_qkv, h, num_warps, 0, self.dtype),
                MMA_O=mma_asm(self.rows_h, q, num_warps, 0, self.dtype),
                MMA_GU=mma_asm(2 * self.rows_inter, h, num_warps, self.rows_inter, self.dtype),
                MMA_DOWN=mma_asm(self.rows_h, self.inter, num_warps, 0, self.dtype),
            )
            if self.fused_attn and group_width % MMA_K_STEP == 0 and self.rbs <= num_warps * 32:
                self.constexprs.update(MMA_OB=mma_asm(self.rbs, group_width, num_warps, 0, self.dtype))
        self._setup_fused_head(model, fused_head, device)
        self._setup_quantized_head(quantized_head, head_candidates, head_scan_rows)
        # Decode bursts in one launch (MULTI_STEP): the kernel picks each step's token and the
        # o tile comes in stage A, which its fixed mbarrier parities assume (_next_step_weights).
        possible = self.fused_head and self.fused_attn and O_LATE
        self.multi_step = possible if multi_step is None else multi_step
        if self.multi_step and not possible:
            raise ValueError("multi_step needs fused_head and O_LATE")
        self.constexprs.update(MULTI_STEP=self.multi_step)

    def _setup_quantized_head(self, quantized_head: bool | None, head_candidates: int | None,
                              head_scan_rows: int | None) -> None:
        """The fused head's pick from an int8 copy of the LM head (HEAD_Q, `quantized_head`; None:
        on with fused_head where slot X holds a chunk, the program's rows' meta and a candidate
        list): head_quant.py, head.py's _stage_head_q. Chunks are as
        many int8 rows as the smaller slot holds (twice the 16-bit head's); head_candidates caps
        the candidates listed per round (default: one per thread; tests set fewer) and
        head_scan_rows the rows each thread scans for candidates at once (HEAD_LR; default: a
        program's rows in one pass, at most 8 per thread; tests set more)."""
        self.quantized_head = False
        if not self.fused_head or self.hidden % MMA_K_STEP:
            if quantized_head:
                raise ValueError(f"quantized_head needs fused_head and hidden_size a multiple of {MMA_K_STEP}")
            return
        threads = self.num_warps * 32
        meta_bytes = align_up(self.rows_vocab * head_quant.META_FIELDS * 4, 128)
        if head_candidates is not None and head_candidates < 1:
            raise ValueError(f"head_candidates must be at least 1, got {head_candidates}")
        need = head_candidates or 16  # list entries (more candidates take more rounds)

        def list_room(rows: int) -> int:
            """Candidate-list entries left in slot X after a chunk of `rows` int8 rows and the meta."""
            return (self.slot_x_bytes - align_up(rows * self.hidden, 128) - meta_bytes) // 4

        cr = min(threads, self.red_rows, self.slot_y_bytes // self.hidden, self.slot_x_bytes // self.hidden)
        while cr >= 1 and list_room(cr) < need:
            cr -= 1
        if cr < 1:
            if quantized_head:
                raise ValueError("quantized_head: slot X cannot hold a chunk, the rows' meta and a candidate list")
            return
        self.quantized_head = quantized_head is None or quantized_head
        if not self.quantized_head:
            return
        meta_off = align_up(cr * self.hidden, 128)
        cap = head_candidates or min(threads, list_room(cr))
        self.head_exponent = head_quant.input_exponent(self.model.model.norm.weight, self.hidden)
        self.head_q, self.head_meta = head_quant.quantize_head(self.head_weight, self.head_exponent)
        # A bounds step's upper bounds (its lower ones go to self.logits): HeadRefine, head_refine.py
        self.logits_hi = torch.zeros_like(self.logits)
        self.constexprs.update(
            HEAD_Q=True, HEAD_Q_CR=cr, MMA_HEAD_Q=mma_asm(cr, self.hidden, self.num_warps, 0, torch.int8),
            HEAD_META_OFF=meta_off, HEAD_CAND_OFF=meta_off + meta_bytes, HEAD_CAP=cap,
            HEAD_X_SCALE=2.0 ** -self.head_exponent,
            HEAD_LR=head_scan_rows or min(8, triton.next_power_of_2(-(-self.rows_vocab // threads))),
        )

    def requantize_head(self) -> None:
        """Make the int8 copy of the LM head again, after its weight changed in place."""
        if self.quantized_head:
            self.head_q, self.head_meta = head_quant.quantize_head(self.head_weight, self.head_exponent)

    def _setup_fused_head(self, model: Any, fused_head: bool | None, device: torch.device) -> None:
        """The LM head and the greedy argmax inside the kernel (FUSED_HEAD, `fused_head`; None: on
        where the projections run on tensor cores from the slots with the o projection fused,
        and the LM head is one rank's whole vocabulary). Its chunks alternate between slots X and
        Y, so a chunk is as many rows as the smaller slot holds."""
        head = getattr(model, "lm_head", None)
        weight = getattr(head, "weight", None)
        possible = (self.mma and self.fused_attn and weight is not None and getattr(head, "tp_size", 1) == 1
                    and tuple(weight.shape) == (head.num_embeddings, self.hidden) and weight.is_contiguous())
        self.fused_head = possible if fused_head is None else fused_head
        self.logits: torch.Tensor | None = None
        self.greedy_token = torch.zeros(1, dtype=torch.int64, device=device)
        self.greedy_temperature = torch.zeros(1, dtype=torch.float32, device=device)  # 0: the argmax
        self.exact_temperature = torch.full((1,), -1.0, dtype=torch.float32, device=device)  # every logit stored
        self.no_seed = torch.zeros(1, dtype=torch.int64, device=device)
        self._token_scratch = torch.zeros(16, dtype=torch.int64, device=device)  # a launch's tokens (see __call__)
        if not self.fused_head:
            return
        if not possible:
            raise ValueError("fused_head needs mma projections with fused_attn, and one rank's whole LM head")
        item = self.dtype.itemsize
        # at most a slot's rows, and the most rows whose sums `red` holds
        cr = min(self.num_warps * 32, min(self.slot_x_bytes, self.slot_y_bytes) // (self.hidden * item), self.red_rows)
        if cr < 1:
            raise ValueError("fused_head: a slot does not hold one row of the LM head")
        self.head_weight = weight
        self.vocab = head.num_embeddings
        self.rows_vocab = -(-self.vocab // self.num_programs)
        self.logits = torch.zeros((1, self.vocab), dtype=self.dtype, device=device)
        self.head_val = torch.zeros(self.num_programs, dtype=torch.float32, device=device)
        self.head_idx = torch.zeros(self.num_programs, dtype=torch.int32, device=device)
        self.constexprs.update(
            FUSED_HEAD=True, HEAD_CR=cr,
            MMA_HEAD=mma_asm(cr, self.hidden, self.num_warps, 0, self.dtype),
            HEAD_PARTS=triton.next_power_of_2(self.num_programs), SAMPLE_BLOCK=GUMBEL_BLOCK,
        )

    def _smem_weights_fit(self, device: torch.device, k_and_chunks: list[tuple[int, int]]) -> bool:
        """Whether weights can go through shared-memory slots here: a persistent launch on an
        sm_90+ GPU (bulk asynchronous copies), slots that leave Triton 64 KB of the opt-in
        shared memory (it takes ~36 KB for Qwen3-0.6B), each K a multiple of its chunk (the
        slot reads are unmasked) and of 16 bytes (the copies' granule)."""
        if not self.persistent or device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
            return False
        optin = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
        item = self.dtype.itemsize
        return self.smem_bytes + 64 * 1024 <= optin and all(k % bk == 0 and k * item % 16 == 0 for k, bk in k_and_chunks)

    def _base(self) -> torch.Tensor:
        return self.model.model.embed_tokens.weight

    def bind(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
        """Point the kernel at these per-layer caches ([blocks, block_size, kv_heads, head_dim])."""
        base = self._base()
        item = base.element_size()

        def offset(t: torch.Tensor | None) -> int:
            if t is None:
                return 0
            if t.dtype != base.dtype or not t.is_contiguous():
                raise ValueError(f"persistent decode needs contiguous {base.dtype} tensors, got {t.dtype}")
            diff = t.data_ptr() - base.data_ptr()
            if diff % (16 * item):  # the kernel tells Triton so (_at), to vectorize loads
                raise ValueError("persistent decode: a tensor does not start 16 elements from the embedding's alignment")
            return diff // item

        if len(k_caches) != self.num_layers or k_caches[0].shape[2:] != (self.num_k, self.head_dim):
            raise ValueError("persistent decode: the KV caches do not match the model")
        rows = []
        for layer, kc, vc, down_t, o_perm in zip(self.model.model.layers, k_caches, v_caches, self.down_t, self.o_perm):
            attn, mlp = layer.self_attn, layer.mlp
            if kc.stride() != k_caches[0].stride() or vc.stride() != kc.stride():
                raise ValueError("persistent decode: every layer's K and V cache must share one layout")
            fields = {
                "qkv_w": attn.qkv_proj.weight, "qkv_b": attn.qkv_proj.bias,
                "q_norm": attn.q_norm.weight if attn.q_norm is not None else None,
                "k_norm": attn.k_norm.weight if attn.k_norm is not None else None,
                "o_w": attn.o_proj.weight, "ln1": layer.input_layernorm.weight, "ln2": layer.post_attention_layernorm.weight,
                "gate_up_w": mlp.gate_up_proj.weight, "down_w": mlp.down_proj.weight, "k_cache": kc, "v_cache": vc,
                "down_t": down_t, "o_perm": o_perm,
            }
            rows.append([offset(fields[name]) for name in _FIELDS])
        self.table = torch.tensor(rows, dtype=torch.int64, device=base.device)
        self.head_off = offset(self.head_weight) if self.fused_head else 0
        self.kv_block_size = k_caches[0].shape[1]
        self.stride_cb, self.stride_cs = k_caches[0].stride(0), k_caches[0].stride(1)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 next_token: torch.Tensor | None = None, temperature: torch.Tensor | None = None,
                 seed: torch.Tensor | None = None, steps: int = 1, record_bytes: int = 0,
                 host_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The hidden state [1, H]. With fused_head, also the logits (into self.logits) and their
        argmax, lowest id on ties, into next_token ([1] int64; None: self.greedy_token); or, where
        the [1] float32 `temperature` is above 0, the token fused_sampler.gumbel_argmax(logits,
        temperature, seed) would sample (seed: [1] int64). With quantized_head the same token
        comes from the int8 head and the logits are not stored, unless the temperature is -1
        (the argmax, every logit stored; None: -1) or -2 (BOUNDS_TEMPERATURE: every logit's
        bounds, into self.logits and self.logits_hi, and no token: head_refine.py).

        steps > 1 (multi_step): a decode burst in this one launch. Step i's inputs (token,
        position, slot, context length, temperature, seed) are the given tensors' elements
        record_bytes * i bytes further (SingleDecodeInputs' records; the block table is shared),
        step i's token goes into step i + 1's input token and the last step's into next_token;
        the hidden state and logits are the last step's. host_tokens (fused_head; int64, at least
        `steps` elements; pinned host memory, which the kernel writes directly): the launch's
        tokens in step order (None: a scratch buffer on the device)."""
        if self.table is None:
            raise RuntimeError("PersistentDecoder: call bind() with the KV caches first")
        if input_ids.shape[0] != 1 or meta.num_decodes != 1:
            raise ValueError("persistent decode runs exactly one decoding sequence")
        if next_token is None:
            next_token = self.greedy_token
        if self.fused_head and (next_token.shape != (1,) or next_token.dtype != torch.int64):
            raise ValueError(f"persistent decode: next_token must be [1] int64, got {tuple(next_token.shape)} {next_token.dtype}")
        temperature = self.exact_temperature if temperature is None else temperature
        seed = self.no_seed if seed is None else seed
        if temperature.shape != (1,) or temperature.dtype != torch.float32 or seed.shape != (1,) or seed.dtype != torch.int64:
            raise ValueError("persistent decode: temperature must be [1] float32 and seed [1] int64")
        if steps != 1:
            if not self.multi_step or steps < 1:
                raise ValueError(f"persistent decode: {steps} steps in one launch need multi_step")
            if record_bytes <= 0 or record_bytes % 8:
                raise ValueError(f"persistent decode: record_bytes must be a positive multiple of 8, got {record_bytes}")
        if host_tokens is None:
            if self._token_scratch.numel() < steps:
                self._token_scratch = torch.zeros(steps, dtype=torch.int64, device=self.greedy_token.device)
            host_tokens = self._token_scratch
        elif host_tokens.dtype != torch.int64 or host_tokens.numel() < steps:
            raise ValueError(f"persistent decode: host_tokens must be int64 with at least {steps} elements")
        if not self.fused_head:  # (a fused head's last program zeroes them: _pick_token)
            self.sync.zero_()
        args = (
            self._base(), self.table, self.model.model.norm.weight, input_ids, self.resid, self.qkv, self.attn_out,
            self.act, self.out, self.acc, self.resid2, self.acc_o, self.part_acc, self.part_ml, self.sync, positions, meta.slot_mapping, meta.seq_lens,
            meta.block_tables, self.cos_sin, self.probe,
            self.eps, self.qk_eps, self.scale * _LOG2E, self.stride_cb, self.stride_cs, self.num_layers,
        )
        counts = (self.rows_qkv, self.rows_h, self.rows_inter)
        common = dict(self.constexprs, KV_BLOCK_SIZE=self.kv_block_size, num_warps=self.num_warps, enable_fp_fusion=False)
        if self.fused_head:
            common.update(head_off=self.head_off, logits_ptr=self.logits, next_tok_ptr=next_token, head_val_ptr=self.head_val,
                          head_idx_ptr=self.head_idx, vocab=self.vocab, rows_vocab=self.rows_vocab, temp_ptr=temperature,
                          seed_ptr=seed, host_tok_ptr=host_tokens)
            if self.quantized_head:
                common.update(head_q_ptr=self.head_q, head_meta_ptr=self.head_meta, head_hi_ptr=self.logits_hi)
        if self.multi_step:
            common.update(num_steps=steps, rec8=record_bytes // 8, rec4=record_bytes // 4)
        grid = (self.num_programs,)
        if self.persistent:
            common.update(PERSISTENT=True, STAGE=0, SMEM_WEIGHTS=self.smem_weights,
                          TABLE_BYTES=self.table_bytes, SLOT_X_BYTES=self.slot_x_bytes, SLOT_Y_BYTES=self.slot_y_bytes)
            if self.smem_weights and self._smem_off is None and not compiling_only():
                kernel = _decode_kernel.warmup(*args, 0, *counts, 0, grid=grid, **common)
                self._smem_off = reserve_shared_memory(kernel, self.smem_bytes)
            launch(_decode_kernel, grid, *args, 0, *counts, self._smem_off or 0, **common)
        else:
            launch(_decode_kernel, grid, *args, 0, *counts, 0, PERSISTENT=False, STAGE=-1, **common)
            for layer in range(self.num_layers):
                for stage in range(_STAGES_PER_LAYER - self.fused_mlp):  # fused_mlp: no stage 4 (fused_attn: 2 is the o part)
                    launch(_decode_kernel, grid, *args, layer, *counts, 0, PERSISTENT=False, STAGE=stage, **common)
            launch(_decode_kernel, grid, *args, 0, *counts, 0, PERSISTENT=False, STAGE=5, **common)
        return self.out
