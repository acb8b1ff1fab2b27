"""The persistent one-sequence decode kernel (nanovllm/fastpath/) against the model's
own forward.

On CPU the kernel runs one launch per stage under TRITON_INTERPRET=1 (conftest.py; the
interpreter runs programs one after another, so the persistent launch's spinning barrier is
GPU-only), at tiny fp32 shapes, with few programs and small context splits so that programs
take several items and sequences several splits. The reference is the model's torch path (fused
ops off, torch attention backend) on the same weights and the same cache contents: logits and
the K/V row stored for the step must agree. On CUDA the persistent launch is compared with the
stepwise one (the same arithmetic, so bit-identical) and with the per-op path at Qwen3-0.6B's
shapes in bf16.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton", reason="triton is not importable; the persistent kernel cannot run")

from nanovllm.attention.backend import bind_kv_cache  # noqa: E402
from nanovllm.attention.metadata import AttentionMetadata  # noqa: E402
from nanovllm.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from nanovllm.fastpath.decoder import PersistentDecoder, unsupported_reason  # noqa: E402
from checkpoints import load_model  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
BLOCK_SIZE = 4
NUM_BLOCKS = 24


def build(path, dtype=torch.float32):
    """The model as the runner builds it (checkpoints.load_model: random norm weights), on the
    torch path (fused ops off), KV caches bound to the torch attention backend."""
    model, config = load_model(path, dtype, DEVICE)
    for m in model.modules():
        if hasattr(m, "fused_devices"):
            m.fused_devices = ()
    attn = model.model.layers[0].self_attn
    n = config.num_hidden_layers
    shape = (NUM_BLOCKS, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim)
    k_caches = [torch.zeros(shape, dtype=dtype, device=DEVICE) for _ in range(n)]
    v_caches = [torch.zeros(shape, dtype=dtype, device=DEVICE) for _ in range(n)]
    bind_kv_cache(model, k_caches, v_caches, TorchAttentionBackend())
    return model, config, k_caches, v_caches


def meta_for(block_table: torch.Tensor, start: int, num_tokens: int, num_decodes: int) -> AttentionMetadata:
    positions = torch.arange(start, start + num_tokens)
    slots = block_table[positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    return AttentionMetadata(
        slot_mapping=slots.to(DEVICE),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([start + num_tokens], dtype=torch.int32, device=DEVICE),
        block_tables=block_table[None].to(DEVICE),
        num_decodes=num_decodes,
        max_query_len=num_tokens,
        max_seq_len=start + num_tokens,
        query_lens_cpu=[num_tokens],
        seq_lens_cpu=[start + num_tokens],
    )


def decode_both(path, context: int, dtype=torch.float32, **decoder_kwargs):
    """Prefill `context - 1` tokens, then decode one token twice from the same cache contents:
    through the model's forward and through the persistent decoder. Returns (reference logits,
    decoder logits, reference caches, decoder caches)."""
    model, config, k_caches, v_caches = build(path, dtype)
    gen = torch.Generator().manual_seed(0)
    # Blocks out of order, so a wrong block-table lookup reads the wrong rows.
    block_table = torch.randperm(NUM_BLOCKS, generator=gen)[: -(-context // BLOCK_SIZE)].to(torch.int32)
    prompt = torch.randint(config.vocab_size, (context - 1,), generator=gen)
    token = torch.randint(config.vocab_size, (1,), generator=gen).to(DEVICE)
    with torch.inference_mode():
        if context > 1:
            model(prompt.to(DEVICE), torch.arange(context - 1, device=DEVICE), meta_for(block_table, 0, context - 1, 0))
        saved = [c.clone() for c in k_caches + v_caches]
        position = torch.tensor([context - 1], device=DEVICE)
        meta = meta_for(block_table, context - 1, 1, 1)
        expected = model.compute_logits(model(token, position, meta)).float()
        expected_caches = [c.clone() for c in k_caches + v_caches]
        for c, s in zip(k_caches + v_caches, saved):
            c.copy_(s)
        decoder = PersistentDecoder(model, **decoder_kwargs)
        decoder.bind(k_caches, v_caches)
        got = model.compute_logits(decoder(token, position, meta)).float()
        decoder.test_inputs = token, position, meta  # what a test may launch it with again
        decoder.test_caches = k_caches, v_caches
    return expected, got, expected_caches, k_caches + v_caches, decoder


CASES = {
    "qwen3-qk-norm": ("qwen3", {}),
    "qwen2-qkv-bias": ("qwen2", dict(num_heads=2, num_kv_heads=1, head_dim=32)),
    "llama-group-4": ("llama", dict(num_heads=4, num_kv_heads=1, head_dim=32)),
}


# Attention layouts with 2 splits of the 44 cached positions of a 45-token context, each a full
# 16-position tile and a partial one: the step's own token in a part of its own (3 parts per KV
# head; 8 programs hold every part), or attended by the last split because the own-token part
# would need more programs than there are (3 for up to 2 x 3 parts), or splits than max_splits
# allows.
SPLITS = {
    "own-token-part": dict(max_splits=4, split_tokens=23, block_t=16, num_programs=8),
    "own-token-part-no-free-program": dict(max_splits=4, split_tokens=23, block_t=16),
    "own-token-part-no-split-left": dict(max_splits=2, split_tokens=3, block_t=16, num_programs=8),
}


# Each layout at the first token (no cached position: one empty split, and the own-token part
# where a program is free for it) and at 45, but for no-split-left, whose first token is laid
# out as own-token-part's (its max_splits of 2 is reached at 45 only).
LAYOUTS = [pytest.param(splits, context, id=f"{splits}-{name}") for splits in SPLITS
           for context, name in ((1, "first-token"), (45, "context-45"))
           if (splits, context) != ("own-token-part-no-split-left", 1)]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("splits, context", LAYOUTS)
def test_stepwise_matches_model(checkpoint_factory, case, context, splits):
    arch, shape = CASES[case]
    path = checkpoint_factory(arch, **shape)
    # 3 programs unless the layout says otherwise: each takes several row slices and attention parts.
    expected, got, expected_caches, caches, _ = decode_both(
        path, context, persistent=False, **{"num_programs": 3, **SPLITS[splits]}
    )
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    for c, e in zip(caches, expected_caches):
        torch.testing.assert_close(c, e, atol=1e-5, rtol=1e-5)  # the step's K (rotated) and V row: fp32 sums in another order


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("programs", [1, 3, 8])
@pytest.mark.parametrize("fused_attn", [False, True], ids=["mlp", "mlp+attn-o"])
def test_stepwise_fused_mlp_matches_model(checkpoint_factory, case, programs, fused_attn):
    """The MLP in one stage (fused_mlp): the down projection split by K, each program's partial
    sums added into the accumulator's copies with atomics, which the next layer's first stage,
    its o stage and the final norm add to the residual. 1 program holds every slice, 3 several
    each, 8 leave some without any (their copies stay zero); programs share the copies.
    With fused_attn the o projection is split by KV head and row block after attention, its
    sums meet in a second accumulator, and the residual moves between two buffers (stepwise, the
    o part is a launch of its own; with 1 program and 2 KV heads it is refused, below)."""
    arch, shape = CASES[case]
    model_kv_heads = shape.get("num_kv_heads", 2)  # checkpoints.make_checkpoint's default
    if fused_attn and programs < model_kv_heads:
        pytest.skip("fused_attn needs a program per KV head (tested below)")
    expected, got, expected_caches, caches, decoder = decode_both(
        checkpoint_factory(arch, **shape), 45, persistent=False, num_programs=programs, fused_mlp=True,
        fused_attn=fused_attn, max_splits=4, split_tokens=23, block_t=16,
    )
    assert decoder.fused_mlp and not decoder.smem_weights and decoder.fused_attn == fused_attn
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    for c, e in zip(caches, expected_caches):
        torch.testing.assert_close(c, e, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def stepwise_decoder(checkpoint_factory):
    """A decoder with its defaults on the stepwise launches, after one step."""
    return decode_both(checkpoint_factory("qwen3"), 5, persistent=False, num_programs=3)[-1]


def test_fused_mlp_is_on_with_the_shared_memory_slots_only(stepwise_decoder):
    """By default the MLP is fused where the weights go through shared memory (the small models
    a lone sequence's latency is about; it keeps a transposed copy of the down weights), so the
    stepwise launches, which never take the slots, keep two MLP stages unless asked."""
    decoder = stepwise_decoder
    assert not decoder.fused_mlp and decoder.down_t == [None] * decoder.num_layers
    assert not decoder.fused_attn and decoder.o_perm == [None] * decoder.num_layers
    with pytest.raises(ValueError, match="fused_attn needs fused_mlp"):
        PersistentDecoder(decoder.model, num_programs=3, fused_mlp=False, fused_attn=True)
    with pytest.raises(ValueError, match="a program per KV head"):
        PersistentDecoder(decoder.model, num_programs=1, fused_mlp=True, fused_attn=True)


def test_more_splits_than_allowed_and_one_program(checkpoint_factory):
    """A context longer than max_splits * split_tokens (each split takes more), one program doing
    every item, and the split counters reused across layers."""
    path = checkpoint_factory("qwen3")
    expected, got, _, _, decoder = decode_both(
        path, 21, num_programs=1, persistent=False, max_splits=2, split_tokens=2, block_t=16
    )
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    assert decoder.sync[1 : 1 + decoder.num_k].tolist() == [0] * decoder.num_k  # the last split of each head reset its count


def test_unsupported_models(checkpoint_factory):
    path = checkpoint_factory("llama", num_heads=4, num_kv_heads=1, head_dim=16, attention_bias=True)
    model, *_ = build(path)
    assert unsupported_reason(model) == "o/MLP projection biases"
    with pytest.raises(ValueError, match="o/MLP projection biases"):
        PersistentDecoder(model, num_programs=2)
    ok, *_ = build(checkpoint_factory("qwen3"))
    assert unsupported_reason(ok) is None
    decoder = PersistentDecoder(ok, num_programs=2)
    with pytest.raises(RuntimeError, match="bind"):
        decoder(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), None)


@pytest.mark.parametrize("host_knows_token", [True, False], ids=["token-from-host", "token-left-in-place"])
def test_single_decode_inputs_arrive_in_one_copy(host_knows_token):
    """The lone-sequence graph's inputs are views of one byte buffer: the bytes fill_host writes,
    copied from 0 (the host knows the token) or from POSITION (the token is the one the last
    replay left in place), give every view its value, and each view starts 16 bytes apart."""
    from nanovllm.fastpath.graphs import SingleDecodeInputs

    s = SingleDecodeInputs(max_blocks=6, max_model_len=96, device=torch.device("cpu"))
    assert (s.slot.item(), s.seq_len.item()) == (-1, 1)  # stores nothing until filled
    s.token.fill_(777)  # the previous replay's argmax
    host = torch.zeros(s.nbytes, dtype=torch.uint8).numpy()
    s.fill_host(host, token=42, position=37, block_table=[9, 4, 7], block_size=16)
    start = 0 if host_knows_token else s.POSITION
    s.buffer[start:].copy_(torch.from_numpy(host[start:]))
    assert s.token.item() == (42 if host_knows_token else 777)
    assert s.position.item() == 37
    assert s.slot.item() == 7 * 16 + 5  # position 37: block index 2 of the table, offset 5
    assert s.seq_len.item() == 38
    assert s.block_table[0, :3].tolist() == [9, 4, 7]
    meta = s.meta()
    assert meta.num_decodes == 1 and meta.block_tables.shape == (1, 6)
    views = (s.token, s.position, s.slot, s.seq_len, s.block_table)
    assert all((v.data_ptr() - s.buffer.data_ptr()) % 16 == 0 for v in views)


def test_decode_burst_inputs_fill_one_record_per_step():
    """A burst's inputs: one 96-byte record per step (position, slot, context length, temperature
    and seed; the token of the first only), the block table after the records, every view
    16-byte aligned. The graph writes step i's token into record i + 1 and the last into record
    0, so its tokens in order are records 1..K-1, then 0 (BurstTokens.in_order). A greedy
    stream's records say temperature 0; a sampling stream's, its temperature and a seed per
    step; a step whose sampler needs every logit says so (all_logits), in the kernel's
    convention: a temperature below 0."""
    from nanovllm.fastpath.graphs import BurstTokens, SingleDecodeInputs

    s = SingleDecodeInputs(max_blocks=6, max_model_len=96, device=torch.device("cpu"), steps=3)
    assert [v.item() for v in s.slots] == [-1] * 3 and [v.item() for v in s.seq_lens] == [1] * 3
    host = torch.zeros(s.nbytes, dtype=torch.uint8).numpy()
    s.fill_host(host, token=42, position=15, block_table=[9, 4, 7], block_size=8, steps=3)
    s.buffer.copy_(torch.from_numpy(host))
    assert s.token.item() == 42 and s.tokens[0] is s.token
    assert [p.item() for p in s.positions] == [15, 16, 17]
    assert [v.item() for v in s.slots] == [4 * 8 + 7, 7 * 8 + 0, 7 * 8 + 1]  # position 16 starts block 2
    assert [v.item() for v in s.seq_lens] == [16, 17, 18]
    assert s.block_table[0, :3].tolist() == [9, 4, 7]
    assert [v.item() for v in s.temperatures] == [0.0] * 3 and [v.item() for v in s.seeds] == [0] * 3
    views = (*s.tokens, *s.positions, *s.slots, *s.seq_lens, *s.temperatures, *s.seeds, s.block_table)
    assert all((v.data_ptr() - s.buffer.data_ptr()) % 16 == 0 for v in views)
    s.fill_host(host, token=42, position=15, block_table=[9, 4, 7], block_size=8, steps=3, temperature=0.75,
                seeds=[5, 6, 2**31 - 2])
    s.buffer.copy_(torch.from_numpy(host))
    assert [v.item() for v in s.temperatures] == [0.75] * 3 and [v.item() for v in s.seeds] == [5, 6, 2**31 - 2]
    assert [p.item() for p in s.positions] == [15, 16, 17] and s.token.item() == 42
    s.fill_host(host, token=42, position=15, block_table=[9, 4, 7], block_size=8, steps=1, temperature=0.75,
                all_logits=True)  # a step whose sampler needs every logit
    s.buffer.copy_(torch.from_numpy(host))
    assert s.temperatures[0].item() < 0 and s.seeds[0].item() == 0
    # A filtered stream: every logit for the kernel, and the sampler's settings and a seed per
    # step in the bytes the kernel does not read; the kernel's own fields keep their values.
    s.fill_host(host, token=42, position=15, block_table=[9, 4, 7], block_size=8, steps=3,
                seeds=[7, 8, 9], filters=(0.6, 20, 0.95, 0.05))
    s.buffer.copy_(torch.from_numpy(host))
    assert all(v.item() < 0 for v in s.temperatures) and [v.item() for v in s.seeds] == [7, 8, 9]
    assert [round(v.item(), 6) for v in s.sample_temperatures] == [0.6] * 3
    assert [v.item() for v in s.top_ks] == [20] * 3
    assert [round(v.item(), 6) for v in s.top_ps] == [0.95] * 3 and [round(v.item(), 6) for v in s.min_ps] == [0.05] * 3
    assert [p.item() for p in s.positions] == [15, 16, 17] and [v.item() for v in s.seq_lens] == [16, 17, 18]
    assert all(v.tolist() == [0.0, 0.0, 1.0] for v in s.penalty_knobs)  # no penalties
    # Its penalties (presence, frequency, repetition), read by the filtered graphs' penalty kernel.
    s.fill_host(host, token=42, position=15, block_table=[9, 4, 7], block_size=8, steps=3,
                seeds=[7, 8, 9], filters=(0.6, 20, 0.95, 0.05), penalties=(0.5, -0.25, 1.5))
    s.buffer.copy_(torch.from_numpy(host))
    assert all(v.tolist() == [0.5, -0.25, 1.5] for v in s.penalty_knobs)
    assert [v.item() for v in s.top_ks] == [20] * 3 and [v.item() for v in s.seq_lens] == [16, 17, 18]
    assert [round(v.item(), 6) for v in s.sample_temperatures] == [0.6] * 3 and all(v.item() < 0 for v in s.temperatures)
    kernel_fields = {s.TOKEN, s.POSITION, s.SLOT, s.SEQ_LEN, s.TEMPERATURE, s.SEED}
    sampler_fields = {s.SAMPLE_TEMPERATURE, s.TOP_K, s.TOP_P, s.MIN_P}
    assert not kernel_fields & sampler_fields and all(
        not (k <= f < k + 8) for f in sampler_fields for k in kernel_fields if k not in (s.SEQ_LEN, s.TEMPERATURE))
    widths = {s.TOKEN: 8, s.POSITION: 8, s.SLOT: 8, s.SEQ_LEN: 4, s.TEMPERATURE: 4, s.SEED: 8, s.SAMPLE_TEMPERATURE: 4,
              s.TOP_K: 4, s.TOP_P: 4, s.MIN_P: 4, s.PENALTY_KNOBS: 12}
    spans = sorted((f, f + w) for f, w in widths.items())
    assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:])) and spans[-1][1] <= s.RECORD
    for i, t in enumerate((101, 102, 103)):  # what the burst graph leaves: step i's token in record i + 1
        s.tokens[(i + 1) % 3].fill_(t)
    assert s.records[:, 0].tolist() == [103, 101, 102]
    assert BurstTokens.in_order(s.records[:, 0].tolist()) == [101, 102, 103]


class FakeGraphs:
    """Stands in for LoneGraphs in the adoption tests: records capture's calls."""

    def __init__(self, fail: bool = False) -> None:
        self.single_graph = None
        self.burst_graphs: dict = {}
        self.fail = fail

    @property
    def has_single(self) -> bool:
        return self.single_graph is not None

    def capture(self, step, burst=1, one_launch=False, filtered_step=None, top_k_step=None) -> None:
        if self.fail:
            raise RuntimeError("capture failed")
        self.single_graph = step
        self.burst = burst
        self.one_launch = one_launch
        self.filtered_step = filtered_step
        self.top_k_step = top_k_step


def fastpath_with_background_compile(graphs: FakeGraphs, dry_pass):
    """A FastPath reduced to what the background compile and its adoption touch."""
    from nanovllm.fastpath.seam import FastPath

    fast = FastPath.__new__(FastPath)
    fast.runner = SimpleNamespace(config=SimpleNamespace(decode_burst=None))
    fast.graphs, fast.decoder = graphs, SimpleNamespace(multi_step=True)
    fast._dry_pass, fast._pending = dry_pass, None
    fast.refine = SimpleNamespace()  # (an int8 head's HeadRefine: the top-k graphs are captured too)
    return fast


def test_background_compile_is_adopted_or_leaves_the_per_op_path(caplog):
    pytest.importorskip("triton.runtime._async_compile", reason="this Triton has no async compile mode")
    ran = []
    fast = fastpath_with_background_compile(FakeGraphs(), lambda: ran.append(True))
    decoder = fast.decoder
    assert fast.decode_burst == 1  # nothing captured yet
    fast.finish_background_compile()
    assert ran == [True] and fast.graphs.single_graph == fast._lone_step and fast.decoder is decoder
    assert fast.graphs.burst == 8  # the default decode burst's graph is captured with it
    assert fast.graphs.one_launch  # in one launch, as the decoder can (multi_step)
    assert fast.graphs.filtered_step == fast._lone_filtered_step  # and the filtered streams' graphs
    assert fast.graphs.top_k_step == fast._lone_top_k_step  # and the top-k streams'
    fast.finish_background_compile()  # nothing left to do
    assert ran == [True]

    def broken():
        raise RuntimeError("compile failed")

    for graphs, dry_pass, reason in ((FakeGraphs(fail=True), lambda: None, "capture failed"),
                                     (FakeGraphs(), broken, "compile failed")):
        fast = fastpath_with_background_compile(graphs, dry_pass)
        with caplog.at_level("WARNING", logger="nanovllm"):
            fast.finish_background_compile()
        assert fast.decoder is None and not graphs.has_single and not fast.lone_sampling
        assert f"persistent decode off: {reason}" in caplog.text


class EagerStaging:
    """Stands in for HostStaging on the CPU: the slot is a numpy array, an upload a copy."""

    def take(self, nbytes: int):
        import numpy as np

        self.buf = np.zeros(nbytes, dtype=np.uint8)
        return self.buf

    def upload(self, start: int, end: int, out: torch.Tensor, stream=None) -> torch.Tensor:
        return out.copy_(torch.from_numpy(self.buf[start:end]))


class EagerReplay:
    """Stands in for the lone-sequence CUDA graph: runs what LoneGraphs.capture records (the step
    over the single inputs, its token into their own token) eagerly."""

    def __init__(self, graphs, step) -> None:
        self.graphs, self.step = graphs, step

    def replay(self) -> None:
        s = self.graphs.single
        self.graphs.single_logits = self.step(s.token, s.position, s.meta(), s.token, s.temperatures[0], s.seeds[0])


class EagerFilteredReplay:
    """Stands in for the filtered graph of one step: runs FastPath._lone_filtered_step eagerly
    over the single inputs, its token into their own token."""

    def __init__(self, graphs, filtered_step) -> None:
        self.graphs, self.filtered_step = graphs, filtered_step

    def replay(self) -> None:
        self.filtered_step(self.graphs.single, 0, self.graphs.single.token)


def eager_fast_path(model, config, k_caches, v_caches):
    """A FastPath on the tests' device over a runner reduced to what it uses, the stepwise kernel for the
    persistent one (few programs and small context splits, as above); no graph captured yet."""
    from nanovllm.fastpath.seam import FastPath
    from nanovllm.layers.sampler import Sampler
    from nanovllm.runner.model_runner import ModelRunner
    from nanovllm.runner.penalty_state import PenaltyState
    from nanovllm.step_result import ReadbackSlots

    runner = SimpleNamespace(
        model=model, device=DEVICE, dtype=torch.float32, block_size=BLOCK_SIZE, rank=0,
        config=SimpleNamespace(decode_burst=1, max_model_len=NUM_BLOCKS * BLOCK_SIZE),
        staging=EagerStaging(), graph_runner=SimpleNamespace(capture_in_pool=None),
        prev_tokens=None, prev_rows={}, generators={}, sampler=Sampler(),
        penalty_state=PenaltyState(config.vocab_size, DEVICE),
        readback=ReadbackSlots() if DEVICE.type == "cuda" else None,
    )
    runner.sample = lambda rows, logits: ModelRunner.sample(runner, rows, logits)
    runner.run_steps = lambda item, launch: ModelRunner.run_steps(runner, item, launch)
    decoder = PersistentDecoder(model, num_programs=3, persistent=False, max_splits=4, block_t=16)
    decoder.bind(k_caches, v_caches)
    fast = FastPath(runner, decoder)
    fast._dry_pass = None  # no background compile: the "graph" runs eagerly
    return fast


def test_fast_path_takes_lone_decodes_through_the_seam(checkpoint_factory):
    """FastPath.take end to end on the tests' device, its graph replaced by an eager call of the same step
    (the stepwise kernel, then GreedyRow): a lone greedy decode's token, then a decode burst with
    no burst graph (one lone step per token, each input the token the last left in place), then
    a step that wants logprobs (the runner's sampler, from the step's logits) give the model's
    own greedy tokens; a batch of two is left to the runner."""
    from nanovllm.sampling_params import SamplingParams
    from nanovllm.step import PLACEHOLDER_TOKEN, ScheduledSeq, SchedulerOutput

    model, config, k_caches, v_caches = build(checkpoint_factory("qwen3"))
    gen = torch.Generator().manual_seed(0)
    context = 9
    table = torch.randperm(NUM_BLOCKS, generator=gen)[:6].to(torch.int32)
    prompt = torch.randint(config.vocab_size, (context,), generator=gen).to(DEVICE)
    expected, token = [], prompt[-1:]
    with torch.inference_mode():
        model(prompt[:-1], torch.arange(context - 1, device=DEVICE), meta_for(table, 0, context - 1, 0))
        saved = [c.clone() for c in k_caches + v_caches]
        for pos in range(context - 1, context + 3):  # the model's own greedy decode
            token = model.compute_logits(model(token, torch.tensor([pos], device=DEVICE), meta_for(table, pos, 1, 1))).argmax(-1)
            expected.append(token.item())
        for c, c0 in zip(k_caches + v_caches, saved):
            c.copy_(c0)

    fast = eager_fast_path(model, config, k_caches, v_caches)
    item = ScheduledSeq(7, [prompt[-1].item()], context - 1, table.tolist(), True, SamplingParams(temperature=0), None, None)
    with torch.inference_mode():
        assert fast.take(SchedulerOutput([item], 1, 1)) is None  # nothing captured yet
        fast.graphs.single_graph = EagerReplay(fast.graphs, fast._lone_step)
        assert fast.take(SchedulerOutput([item, item], 2, 2)) is None  # a batch: the runner's
        got = fast.take(SchedulerOutput([item], 1, 1)).result().token_ids
        burst = ScheduledSeq(7, [PLACEHOLDER_TOKEN], context, table.tolist(), True, SamplingParams(temperature=0), None,
                             None, num_steps=2)
        got += fast.take(SchedulerOutput([burst], 1, 2)).result().token_ids
        wants_logprobs = ScheduledSeq(7, [PLACEHOLDER_TOKEN], context + 2, table.tolist(), True,
                                      SamplingParams(temperature=0, logprobs=2), None, None)
        out = fast.take(SchedulerOutput([wants_logprobs], 1, 1)).result()
    assert got + out.token_ids == expected
    assert out.logprobs[0] is not None and len(out.logprobs[0][1]) == 2


def test_fast_path_takes_a_penalized_lone_stream_through_the_filtered_graph(checkpoint_factory):
    """FastPath.take end to end on the tests' device with its filtered graph replaced by an eager call of
    the same step (the stepwise kernel, the penalty kernel, the filtered sampler's argmax, the
    count): a greedy stream with presence, frequency and repetition penalties and a logit bias
    decodes the tokens of a plain torch loop over the model's logits, through lone steps, a decode
    burst, a step in a batch (the runner's per-op penalties, after the fast path wrote its counts
    back) and lone steps again (its counts loaded again)."""
    from collections import Counter

    from nanovllm.sampling_params import SamplingParams
    from nanovllm.step import PLACEHOLDER_TOKEN, ScheduledSeq, SchedulerOutput

    model, config, k_caches, v_caches = build(checkpoint_factory("qwen3"))
    gen = torch.Generator().manual_seed(1)
    context = 9
    table = torch.randperm(NUM_BLOCKS, generator=gen)[:6].to(torch.int32)
    prompt = torch.randint(config.vocab_size, (context,), generator=gen).to(DEVICE)
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                            logit_bias={int(prompt[0]): 0.5, 3: -100.0})
    steps = 6

    def edited(logits: torch.Tensor, output: list[int]) -> torch.Tensor:
        x = logits[0].clone()
        for t, b in params.logit_bias.items():
            x[t] += b
        counts = Counter(output)
        for t in set(prompt.tolist()) | set(output):
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
            x[t] -= params.frequency_penalty * counts[t] + params.presence_penalty * (counts[t] > 0)
        return x

    expected, token = [], prompt[-1:]
    with torch.inference_mode():
        model(prompt[:-1], torch.arange(context - 1, device=DEVICE), meta_for(table, 0, context - 1, 0))
        saved = [c.clone() for c in k_caches + v_caches]
        for pos in range(context - 1, context - 1 + steps):  # the penalized greedy decode
            logits = model.compute_logits(model(token, torch.tensor([pos], device=DEVICE), meta_for(table, pos, 1, 1)))
            token = edited(logits, expected).argmax(-1, keepdim=True)
            expected.append(token.item())
        for c, c0 in zip(k_caches + v_caches, saved):
            c.copy_(c0)

    fast = eager_fast_path(model, config, k_caches, v_caches)
    runner, state = fast.runner, fast.runner.penalty_state
    g = fast.graphs
    g.single_graph = EagerReplay(g, fast._lone_step)
    g.filtered_single_graph = EagerFilteredReplay(g, fast._lone_filtered_step)

    def lone(pos: int, num_steps: int = 1, prompt_ids=None) -> list[int]:
        item = ScheduledSeq(7, [prompt[-1].item()] if pos == context - 1 else [PLACEHOLDER_TOKEN], pos, table.tolist(),
                            True, params, None, None, num_steps=num_steps, penalty_prompt_ids=prompt_ids)
        return fast.take(SchedulerOutput([item], 1, num_steps)).result().token_ids

    with torch.inference_mode():
        got = lone(context - 1, prompt_ids=prompt.tolist())  # its first sampling step: counts from the prompt
        got += lone(context, num_steps=2)  # no burst graph: two filtered lone steps
        assert fast.penalties.owner == 7
        # A batch step: the fast path declines it and writes the counts back; the runner samples
        # from its row with the per-op penalties (one row of the batch here).
        pos = context + 2
        item = ScheduledSeq(7, [got[-1]], pos, table.tolist(), True, params, None, None)
        assert fast.take(SchedulerOutput([item, item], 2, 2)) is None and fast.penalties.owner is None
        logits = model.compute_logits(model(torch.tensor(got[-1:], device=DEVICE), torch.tensor([pos], device=DEVICE),
                                            meta_for(table, pos, 1, 1)))
        got += runner.sample([item], logits).token_ids.tolist()
        runner.prev_tokens, runner.prev_rows = torch.tensor(got[-1:], device=DEVICE), {7: 0}
        got += lone(pos + 1, num_steps=2)  # alone again: the counts come back with the batch's token
    assert got == expected
    counts = Counter(expected)
    row = state.counts[state.slots[7]] if fast.penalties.owner is None else fast.penalties.counts
    assert {t: row[t].item() for t in counts} == dict(counts) and row.sum().item() == steps


# ---- CUDA ------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="the persistent launch needs a CUDA device (its grid barrier spins)")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("splits", list(SPLITS))
def test_cuda_persistent_matches_stepwise_and_model(checkpoint_factory, case, splits):
    arch, shape = CASES[case]
    path = checkpoint_factory(arch, **shape)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    kwargs = dict(SPLITS[splits], num_programs=sms, fused_mlp=False)  # the fused MLP's sums depend on the atomics' order
    expected, persistent, _, caches, _ = decode_both(path, 45, **kwargs)
    _, stepwise, _, step_caches, _ = decode_both(path, 45, persistent=False, **kwargs)
    assert torch.equal(persistent, stepwise)
    for a, b in zip(caches, step_caches):
        assert torch.equal(a, b)
    torch.testing.assert_close(persistent, expected, atol=2e-5, rtol=2e-5)


@needs_cuda
@pytest.mark.gpu
def test_cuda_bf16_close_to_model(checkpoint_factory):
    """bf16: the same roundings as the per-op path, but fp32 sums in another order than cuBLAS,
    so logits agree to a few bf16 units; persistent and stepwise stay bit-identical (with FMA
    projections; the tensor-core ones are tested below)."""
    path = checkpoint_factory("qwen3")
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    expected, persistent, *_ = decode_both(path, 40, torch.bfloat16, num_programs=sms, mma_projections=False,
                                           fused_mlp=False)
    _, stepwise, *_ = decode_both(path, 40, torch.bfloat16, num_programs=sms, persistent=False)
    assert torch.equal(persistent, stepwise)
    torch.testing.assert_close(persistent, expected, atol=3e-2, rtol=3e-2)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("programs", ["one-per-sm", "8"])
def test_cuda_weights_through_shared_memory_match_registers(checkpoint_factory, case, dtype, programs):
    """The shared-memory weight slots (bulk copies, mbarriers, inline-PTX shared loads) give the
    register path's results bit for bit: same values, same per-thread layout, same sums. With 8
    programs each copies a larger slice (more rows per program)."""
    if torch.cuda.get_device_capability(DEVICE) < (9, 0):
        pytest.skip("bulk asynchronous copies need sm_90")
    arch, shape = CASES[case]
    path = checkpoint_factory(arch, **shape)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    kwargs = dict(num_programs=sms if programs == "one-per-sm" else 8, max_splits=4, split_tokens=23, block_t=16,
                  fused_mlp=False)
    _, smem, _, smem_caches, decoder = decode_both(path, 45, dtype, smem_weights=True, mma_projections=False, **kwargs)
    assert decoder.smem_weights and decoder._smem_off is not None
    _, registers, _, caches, plain = decode_both(path, 45, dtype, smem_weights=False, **kwargs)
    assert not plain.smem_weights
    assert torch.equal(smem, registers)
    for a, b in zip(smem_caches, caches):
        assert torch.equal(a, b)


# Shapes whose every K (hidden, query width, intermediate) is a multiple of mma_asm's 128-column
# step, so that the tensor-core projections apply; 8 programs give them 16-48 rows each.
MMA_CASES = {
    "qwen3-qk-norm": ("qwen3", dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32)),
    "qwen2-qkv-bias": ("qwen2", dict(hidden_size=128, intermediate_size=512, num_heads=4, num_kv_heads=1, head_dim=32)),
    "llama-group-4": ("llama", dict(hidden_size=256, intermediate_size=256, num_heads=4, num_kv_heads=1, head_dim=64)),
}


def slots_case(checkpoint_factory, case: str, programs: str):
    """(checkpoint, decoder keywords) of an MMA_CASES model with one program per SM, 8 or 3;
    skips where the GPU has no bulk asynchronous copies (the slots')."""
    if torch.cuda.get_device_capability(DEVICE) < (9, 0):
        pytest.skip("bulk asynchronous copies need sm_90")
    arch, shape = MMA_CASES[case]
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    count = {"one-per-sm": sms, "8": 8, "3": 3}[programs]
    return checkpoint_factory(arch, **shape), dict(num_programs=count, max_splits=4, split_tokens=23, block_t=16)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", list(MMA_CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("programs", ["one-per-sm", "8", "3"])
def test_cuda_tensor_core_projections_close_to_model(checkpoint_factory, case, dtype, programs):
    """16-bit weights: projections on tensor cores straight from the shared-memory slots
    (ldmatrix + mma on the diagonal mapping, mma_asm). Their fp32 sums run in another order than
    the FMA path's, so logits agree with the model's and with the FMA path's to a few units of
    the dtype, where a wrong fragment, chunk or row mapping would not; the step's K/V land in the
    cache as the model's do. One program per SM gives pairs shared by several warps, 8 and 3
    programs several pairs per warp (and an odd row count)."""
    path, kwargs = slots_case(checkpoint_factory, case, programs)
    expected, mma, expected_caches, caches, decoder = decode_both(path, 45, dtype, **kwargs)
    assert decoder.mma
    _, fma, _, _, plain = decode_both(path, 45, dtype, mma_projections=False, **kwargs)
    assert not plain.mma
    # The tensor cores' fp32 accumulation is not rounded as FMAs round it: within twice the FMA
    # path's own distance from the model (plus a bf16 unit), where a wrong mapping is far off.
    mma_error, fma_error = (mma - expected).abs().max().item(), (fma - expected).abs().max().item()
    assert mma_error <= 2 * fma_error + 1e-2, (mma_error, fma_error)
    torch.testing.assert_close(mma, fma, atol=5e-2, rtol=5e-2)
    assert mma.std() > 0.1  # a wrong mapping that zeroed the projections would give flat logits
    for c, e in zip(caches, expected_caches):
        torch.testing.assert_close(c, e, atol=2e-2, rtol=2e-2)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", list(MMA_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("programs", ["one-per-sm", "8", "3"])
@pytest.mark.parametrize("fused_attn", [False, True], ids=["mlp", "mlp+attn-o"])
def test_cuda_fused_mlp_close_to_two_stages(checkpoint_factory, case, dtype, programs, fused_attn):
    """The persistent launch with the MLP in one stage (fused_mlp, on by default with the slots:
    the transposed down rows come through slot Y, the partial sums meet in the accumulator by
    atomics) against the two-stage MLP and the model. fp32: within fp32 rounding; bf16 (tensor
    cores): within twice the two-stage kernel's distance from the model, and the step's K/V as
    the model's. 8 and 3 programs give each program a larger slice of every stage. With
    fused_attn the o projection follows attention too (each item waits for its KV head's parts'
    count, combines them and adds its rows' sums with atomics): three stages per layer."""
    path, kwargs = slots_case(checkpoint_factory, case, programs)
    expected, fused, expected_caches, caches, decoder = decode_both(path, 45, dtype, fused_mlp=True,
                                                                    fused_attn=fused_attn, **kwargs)
    assert decoder.fused_mlp and decoder.fused_attn == fused_attn
    _, two, _, _, plain = decode_both(path, 45, dtype, fused_mlp=False, **kwargs)
    assert not plain.fused_mlp
    if dtype == torch.float32:
        torch.testing.assert_close(fused, two, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(fused, expected, atol=2e-5, rtol=2e-5)
    else:
        fused_error, two_error = (fused - expected).abs().max().item(), (two - expected).abs().max().item()
        assert fused_error <= 2 * two_error + 1e-2, (fused_error, two_error)
        assert fused.std() > 0.1
    for c, e in zip(caches, expected_caches):
        torch.testing.assert_close(c, e, atol=2e-2 if dtype != torch.float32 else 1e-5, rtol=2e-2 if dtype != torch.float32 else 1e-5)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", list(MMA_CASES))
@pytest.mark.parametrize("programs", ["one-per-sm", "8", "3"])
def test_cuda_fused_head_equals_cublas_logits_and_their_argmax(checkpoint_factory, case, programs):
    """The LM head and the greedy argmax inside the kernel (fused_head, on by default with the
    tensor-core slots): the hidden state is the one without it (to the last bits that the MLP's
    atomics leave to their order); the logits are cuBLAS's of that hidden state to bf16 rounding
    (the tensor cores sum in another order); the token is torch.argmax of the kernel's own
    logits, launch after launch (the count resets), and ties go to the lowest id, also across
    programs."""
    path, kwargs = slots_case(checkpoint_factory, case, programs)
    _, _, _, _, plain = decode_both(path, 45, torch.bfloat16, fused_head=False, **kwargs)
    expected_hidden = plain.out.clone()
    _, _, _, _, decoder = decode_both(path, 45, torch.bfloat16, **kwargs)
    assert decoder.fused_head and not plain.fused_head
    torch.testing.assert_close(decoder.out, expected_hidden, atol=2e-2, rtol=2e-2)
    head_w = decoder.head_weight
    reference = torch.nn.functional.linear(decoder.out, head_w).float()
    torch.testing.assert_close(decoder.logits.float(), reference, atol=2e-2, rtol=2e-2)
    assert decoder.logits.float().std() > 0.1
    assert decoder.greedy_token.item() == decoder.logits[0].argmax().item()
    # A tie: a lower row (another program's, where there is one) gets the winning row's weights.
    token, position, meta = decoder.test_inputs
    top = decoder.logits[0].float().argmax().item()
    low = max(0, top - 5 * decoder.rows_vocab)
    if low in (top, token.item()):
        return
    head_w[low] = head_w[top]  # (tied to the embedding: not the step's token, so the hidden state stays)
    out = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    for _ in range(3):
        with torch.inference_mode():
            decoder(token, position, meta, out)
        assert out.item() == decoder.logits[0].argmax().item() == low


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", list(MMA_CASES))
@pytest.mark.parametrize("programs", ["one-per-sm", "3"])
def test_cuda_fused_head_samples_what_gumbel_argmax_samples(checkpoint_factory, case, programs):
    """A temperature above 0 makes the fused head sample: the token is the one
    fused_sampler.gumbel_argmax draws from the kernel's own logits at that temperature and seed
    (the same Gumbel noise per row), the logits stay the unperturbed ones, different seeds give
    different tokens, and temperature 0 is the argmax again."""
    from nanovllm.layers.fused_sampler import gumbel_argmax

    path, kwargs = slots_case(checkpoint_factory, case, programs)
    _, _, _, _, decoder = decode_both(path, 45, torch.bfloat16, **kwargs)
    assert decoder.fused_head
    token, position, meta = decoder.test_inputs
    greedy_logits = decoder.logits.clone()
    out = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    drawn = set()
    for seed in (0, 3, 99, 2**31 - 2, 123456):
        for t in (0.5, 1.0, 3.0):
            temperature = torch.tensor([t], device=DEVICE)
            seed_t = torch.tensor([seed], dtype=torch.int64, device=DEVICE)
            with torch.inference_mode():
                decoder(token, position, meta, out, temperature, seed_t)
            torch.testing.assert_close(decoder.logits, greedy_logits, atol=0, rtol=0)
            assert out.item() == gumbel_argmax(decoder.logits, temperature, seed_t).item(), (seed, t)
            drawn.add(out.item())
    assert len(drawn) > 3
    with torch.inference_mode():
        decoder(token, position, meta, out, torch.zeros(1, device=DEVICE), torch.tensor([5], device=DEVICE))
    assert out.item() == greedy_logits[0].argmax().item()


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", list(MMA_CASES))
@pytest.mark.parametrize("programs", ["one-per-sm", "8", "3"])
@pytest.mark.parametrize("scan_rows", [None, 4], ids=["scan-rows-default", "scan-4-rows-per-thread"])
def test_cuda_quantized_head_picks_the_exact_heads_token(checkpoint_factory, case, programs, scan_rows):
    """The pick from the int8 head (quantized_head, on by default with fused_head) against the
    16-bit head of the same launch (a temperature below 0: every logit stored): over 24 input
    tokens (24 hidden states), the argmax and the Gumbel-max samples at three temperatures are
    the 16-bit head's, and the logits are not touched. Then ties, which only the exact
    recompute settles: a lower row given the top row's weights wins; and with many rows equal
    (every row a candidate) and 4 candidates per round, the rounds still give the lowest. The
    candidate scan gives each thread HEAD_LR rows in a row (1 for these small vocabularies, 8
    for Qwen3-0.6B's on 132 SMs); scan_rows=4 runs the many-rows layout here too."""
    from nanovllm.layers.fused_sampler import gumbel_argmax

    path, kwargs = slots_case(checkpoint_factory, case, programs)
    kwargs["head_scan_rows"] = scan_rows
    _, _, _, _, decoder = decode_both(path, 45, torch.bfloat16, **kwargs)
    assert decoder.fused_head and decoder.quantized_head
    assert decoder.constexprs["HEAD_LR"] == (scan_rows or 1)
    _, position, meta = decoder.test_inputs
    out = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    exact = torch.tensor([-1.0], device=DEVICE)

    def picks(token, temperature, seed):
        """(the 16-bit head's token and logits, the int8 head's token) for this input."""
        t = torch.tensor([token], device=DEVICE)
        seed_t = torch.tensor([seed], dtype=torch.int64, device=DEVICE)
        with torch.inference_mode():
            decoder(t, position, meta, out, exact, seed_t)
            logits = decoder.logits.clone()
            want = (logits[0].float().argmax().item() if temperature == 0
                    else gumbel_argmax(logits, torch.tensor([temperature], device=DEVICE), seed_t).item())
            decoder.logits.fill_(float("nan"))
            decoder(t, position, meta, out, torch.tensor([temperature], device=DEVICE), seed_t)
            assert decoder.logits.isnan().all()  # the int8 pick stores no logits
            decoder.logits.copy_(logits)
        return want, out.item()

    seen = set()
    for token in range(0, 384, 16):
        for temperature, seed in ((0.0, 0), (0.7, token + 1), (2.0, 7 * token + 3)):
            want, got = picks(token, temperature, seed)
            assert got == want, (token, temperature, seed)
            seen.add(want)
    assert len(seen) > 10
    token = decoder.test_inputs[0].item()
    top, _ = picks(token, 0.0, 0)
    head_w = decoder.head_weight
    low = max(0, top - 5 * decoder.rows_vocab)
    if low not in (top, token):
        head_w[low] = head_w[top]  # (tied to the embedding: not the step's token, so the hidden state stays)
        decoder.requantize_head()
        want, got = picks(token, 0.0, 0)
        assert got == want == low
    few = PersistentDecoder(decoder.model, head_candidates=4, **kwargs)
    few.bind(*decoder.test_caches)
    assert few.constexprs["HEAD_CAP"] == 4
    decoder = few
    rows = [r for r in range(min(3 * decoder.rows_vocab, head_w.shape[0])) if r != token]
    head_w[rows] = head_w[top].clone()
    decoder.requantize_head()
    for temperature, seed in ((0.0, 0), (1.0, 11)):
        want, got = picks(token, temperature, seed)
        assert got == want, (temperature, seed)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", list(MMA_CASES))
@pytest.mark.parametrize("programs", ["one-per-sm", "8"])
def test_cuda_bounds_step_gives_a_top_k_sample_the_exact_heads_token(checkpoint_factory, case, programs):
    """The bounds step (temperature word -2: the int8 head stores each row's bounds, head.py)
    against the 16-bit head of the same launch (-1): over 24 input tokens the bounds hold every
    16-bit logit; after HeadRefine (fastpath/head_refine.py) the buffer's top k are the 16-bit
    head's rows and values (to the rounding of sums in another order), and the pick from its
    list draws what the filtered sampler draws from every 16-bit logit (top-k 20 with top-p
    0.95, and top-k 5 with min-p 0.1, under several seeds)."""
    from nanovllm.fastpath.head_refine import HeadRefine
    from nanovllm.layers.filtered_sampler import FilteredSampler

    path, kwargs = slots_case(checkpoint_factory, case, programs)
    _, _, _, _, decoder = decode_both(path, 45, torch.bfloat16, **kwargs)
    assert decoder.fused_head and decoder.quantized_head
    _, position, meta = decoder.test_inputs
    out = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    exact_word, bounds_word = torch.tensor([-1.0], device=DEVICE), torch.tensor([-2.0], device=DEVICE)
    seed0 = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    sampler, lister = FilteredSampler(decoder.vocab, 1, DEVICE), FilteredSampler(decoder.vocab, 1, DEVICE)
    refine = HeadRefine(decoder.logits, decoder.logits_hi, decoder.out, decoder.head_weight, decoder.head_val, lister)
    one = lambda v, dtype=torch.float32: torch.tensor([v], dtype=dtype, device=DEVICE)  # noqa: E731
    drawn = set()
    for token in range(0, 384, 16):
        t = torch.tensor([token], device=DEVICE)
        with torch.inference_mode():
            decoder(t, position, meta, out, exact_word, seed0)
            exact = decoder.logits.clone()
            decoder(t, position, meta, out, bounds_word, seed0)
        lo, hi = decoder.logits.clone(), decoder.logits_hi.clone()
        assert bool((lo <= exact).all() and (exact <= hi).all()), token
        for k, top_p, min_p in ((20, 0.95, 0.0), (5, 1.0, 0.1)):
            kth = exact[0].float().topk(k).values[-1]
            top = exact[0].float() >= kth
            for seed in (token, token + 7):
                with torch.inference_mode():
                    decoder.logits.copy_(lo)
                    refine(one(0.6), one(k, torch.int32))
                torch.testing.assert_close(decoder.logits[0][top], exact[0][top], rtol=2.0**-7, atol=0.0)
                assert bool((decoder.logits[0][~top].float() < kth).all()), (token, k)
                args = (one(0.6), one(k, torch.int32), one(top_p), one(min_p), one(seed, torch.int64))
                with torch.inference_mode():
                    want = sampler(exact, *args).item()
                    got = lister.pick_listed(decoder.logits, *args, out=out).item()
                assert got == want, (token, k, seed)
                drawn.add(want)
    assert len(drawn) > 10


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", list(MMA_CASES))
@pytest.mark.parametrize("programs", ["one-per-sm", "8", "3"])
@pytest.mark.parametrize("temperature", [0.0, 1.3], ids=["greedy", "sampled"])
def test_cuda_decode_steps_in_one_launch_equal_a_launch_per_step(checkpoint_factory, case, programs, temperature):
    """A decode burst in one launch (multi_step, on with the fused head): 7 steps whose records
    follow each other (SingleDecodeInputs), across a KV-block boundary, give the tokens (greedy,
    or sampled under each step's seed) and the cached K/V rows of 7 launches of one step each
    from the same cache contents, write step i's token into record i + 1 and the last into
    record 0, and every token in step order into pinned host memory (host_tokens), and leave
    every sync word at 0 for the next launch. A burst also follows a burst
    (the step word starts at 0 again). The int8 head picks each step's token (quantized_head)."""
    path, kwargs = slots_case(checkpoint_factory, case, programs)
    check_burst_in_one_launch(path, kwargs, temperature)


@needs_cuda
@pytest.mark.gpu
def test_cuda_decode_steps_in_one_launch_with_the_16_bit_head(checkpoint_factory):
    """As above with the 16-bit LM head (quantized_head=False: its chunks are half as many rows,
    so the slots' mbarrier phases per step differ), greedy, one program per SM."""
    path, kwargs = slots_case(checkpoint_factory, "qwen3-qk-norm", "one-per-sm")
    check_burst_in_one_launch(path, dict(kwargs, quantized_head=False), 0.0)


def check_burst_in_one_launch(path, kwargs: dict, temperature: float) -> None:
    import numpy as np

    from nanovllm.fastpath.graphs import BurstTokens, SingleDecodeInputs

    _, _, _, _, decoder = decode_both(path, 45, torch.bfloat16, **kwargs)
    assert decoder.fused_head and decoder.multi_step
    assert decoder.quantized_head == kwargs.get("quantized_head", True)
    token, _, meta = decoder.test_inputs
    k_caches, v_caches = decoder.test_caches
    caches = k_caches + v_caches
    saved = [c.clone() for c in caches]
    used = meta.block_tables[0].tolist()
    table = used + [b for b in range(NUM_BLOCKS) if b not in used][:4]  # two bursts: positions 44..57
    steps = 7
    s = SingleDecodeInputs(max_blocks=len(table), max_model_len=NUM_BLOCKS * BLOCK_SIZE, device=DEVICE, steps=steps)
    host = np.zeros(s.nbytes, dtype=np.uint8)

    def fill(first: int, position: int) -> None:
        s.fill_host(host, token=first, position=position, block_table=table, block_size=BLOCK_SIZE, steps=steps,
                    temperature=temperature, seeds=[11 * i + 5 for i in range(steps)])
        s.buffer.copy_(torch.from_numpy(host))

    metas = [s.meta(i) for i in range(steps)]
    on_host = torch.zeros(steps, dtype=torch.int64, pin_memory=True)  # the kernel writes the tokens there too

    def burst(start: list[torch.Tensor], first: int, position: int, one_launch: bool) -> list[int]:
        """From the caches `start` and the inputs of steps at `position` on: the burst's tokens
        in step order (the records', and with one_launch the host's copy of them too)."""
        for c, c0 in zip(caches, start):
            c.copy_(c0)
        fill(first, position)
        with torch.inference_mode():
            if one_launch:
                decoder(s.tokens[0], s.positions[0], metas[0], s.tokens[0], s.temperatures[0], s.seeds[0], steps=steps,
                        record_bytes=s.RECORD, host_tokens=on_host)
            else:
                for i in range(steps):
                    decoder(s.tokens[i], s.positions[i], metas[i], s.tokens[(i + 1) % steps], s.temperatures[i],
                            s.seeds[i])
        tokens = BurstTokens.in_order(s.records[:, 0].tolist())  # (tolist waits for the launches)
        if one_launch:
            assert on_host.tolist() == tokens
        assert decoder.sync.abs().sum().item() == 0
        return tokens

    first = burst(saved, token.item(), 44, one_launch=True)
    first_caches = [c.clone() for c in caches]
    assert first == burst(saved, token.item(), 44, one_launch=False) and len(set(first)) > 1
    for a, b in zip(first_caches, caches):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    # The next burst goes on from there, in one launch again, as launches per step do.
    second = burst(first_caches, first[-1], 44 + steps, one_launch=True)
    assert second == burst(first_caches, first[-1], 44 + steps, one_launch=False)


def test_steps_in_one_launch_are_validated(checkpoint_factory):
    """Several steps in one launch need multi_step (the fused head: CUDA sm_90 slots) and the
    records' stride; on the CPU the decoder has no multi_step and refuses them."""
    model, _, k_caches, v_caches = build(checkpoint_factory("qwen3"))
    decoder = PersistentDecoder(model, num_programs=3, persistent=HAS_CUDA)
    if decoder.multi_step:
        pytest.skip("this device runs several steps in one launch")
    decoder.bind(k_caches, v_caches)
    token = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="multi_step"):
        decoder(token, torch.zeros(1, dtype=torch.int64, device=DEVICE), meta_for(torch.arange(2, dtype=torch.int32), 0, 1, 1),
                steps=2, record_bytes=96)
    with pytest.raises(ValueError, match="multi_step needs"):
        PersistentDecoder(model, num_programs=3, persistent=HAS_CUDA, multi_step=True)


def test_tensor_core_program_refuses_k_off_its_step():
    """mma_asm's K must be a multiple of its 128-column step (the GPU tests check its sums)."""
    from nanovllm.fastpath.ptx import mma_asm

    with pytest.raises(ValueError, match="multiple of 128"):
        mma_asm(8, 1000, 8, 0, torch.bfloat16)


def test_quantized_head_needs_the_fused_head(checkpoint_factory):
    """On the CPU (no slots, so no fused head) the quantized head is off, and asking for it is
    refused with the reason."""
    model, *_ = build(checkpoint_factory("qwen3"))
    decoder = PersistentDecoder(model, num_programs=3, persistent=False)
    assert not decoder.fused_head and not decoder.quantized_head
    with pytest.raises(ValueError, match="quantized_head needs fused_head"):
        PersistentDecoder(model, num_programs=3, persistent=False, quantized_head=True)


def test_k_split_down_program_refuses_a_hidden_size_off_4():
    """down_asm's hidden size must be a multiple of 4 (the GPU tests check its sums)."""
    from nanovllm.fastpath.ptx import down_asm

    with pytest.raises(ValueError, match="multiple of 4"):
        down_asm(2, 130, 256, torch.bfloat16)


def test_weights_through_shared_memory_only_on_a_persistent_cuda_launch(stepwise_decoder):
    """The stepwise launches (the CPU reference path) never take the shared-memory slots."""
    assert not stepwise_decoder.smem_weights


def test_reserving_shared_memory_patches_the_launch_size_once():
    """The slots' shared memory is added to the compiled kernel's launch size (metadata and the
    packed tuple its launcher reads), past Triton's own rounded to 128 bytes; a second call
    changes nothing; a kernel already loaded (launched) is refused rather than run short."""
    from collections import namedtuple

    from triton.backends.compiler import GPUTarget

    from nanovllm.fastpath.ptx import reserve_shared_memory

    Meta = namedtuple("Meta", "num_warps num_ctas shared target")

    class FakeKernel:
        module = None
        metadata = Meta(8, 1, 36_900, GPUTarget("cuda", 90, 32))

    kernel = FakeKernel()
    assert reserve_shared_memory(kernel, 10_000) == 36_992
    assert kernel.metadata.shared == 46_992
    assert kernel.packed_metadata[:3] == (8, 1, 46_992)
    assert reserve_shared_memory(kernel, 10_000) == 36_992
    assert kernel.metadata.shared == 46_992
    loaded = FakeKernel()
    loaded.module = object()
    with pytest.raises(RuntimeError, match="before its shared memory was reserved"):
        reserve_shared_memory(loaded, 10_000)
