"""Engine-level parity on a CUDA device: Triton vs torch attention, CUDA graphs vs eager.

Greedy fp32 output must agree token for token; these run on the GPU machine and skip (with
the reason shown) anywhere else.
"""
from __future__ import annotations

import random
import time

import pytest
import torch

from nanovllm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def prompts(vocab, lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def run(path, **kw):
    kw.setdefault("device", "cuda")
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_model_len", 1024)
    kw.setdefault("gpu_memory_utilization", 0.3)
    llm = LLM(str(path), **kw)
    ps = prompts(llm.engine.vocab_size, [1, 7, 33, 130, 300, 64, 2, 17])
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=24, min_tokens=24), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("shape", [dict(), dict(num_heads=8, num_kv_heads=2, head_dim=64, tie_word_embeddings=False)])
def test_triton_equals_torch_and_graphs_equal_eager(checkpoint_factory, shape):
    path = checkpoint_factory("qwen3", **shape)
    _, ref = run(path, attention_backend="torch", enforce_eager=True)
    llm, eager = run(path, attention_backend="triton", enforce_eager=True)
    assert llm.engine.executor.runner.graph_runner is None
    llm, graphs = run(path, attention_backend="triton", enforce_eager=False)
    assert llm.engine.executor.runner.graph_runner is not None
    assert eager == ref
    assert graphs == ref


def test_cuda_greedy_matches_transformers(checkpoint_factory):
    from transformers import AutoModelForCausalLM

    path = checkpoint_factory("llama", num_heads=4, num_kv_heads=2, head_dim=16)
    llm, ours = run(path, attention_backend="triton")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    ps = prompts(llm.engine.vocab_size, [1, 7, 33, 130, 300, 64, 2, 17])
    for p, o in zip(ps, ours):
        gen = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                             attention_mask=torch.ones(1, len(p), dtype=torch.long, device="cuda"))
        assert gen[0, len(p):].tolist() == o


def test_chunked_prefix_and_preemption_on_gpu(checkpoint_factory):
    path = checkpoint_factory("qwen3")
    _, ref = run(path, enable_prefix_caching=False)
    llm, got = run(path, max_num_batched_tokens=64, num_kvcache_blocks=40, kvcache_block_size=16)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == ref
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_engine_on_another_thread_replays_graphs(checkpoint_factory):
    """The server steps the engine on its own thread: CUDA graphs captured on the main thread
    must replay there with the same results."""
    import threading

    path = checkpoint_factory("qwen3")
    llm, ref = run(path)
    assert llm.engine.executor.runner.graph_runner is not None
    ps = prompts(llm.engine.vocab_size, [1, 7, 33, 130, 300, 64, 2, 17])
    box = {}

    def work():
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=24, min_tokens=24), use_tqdm=False)
        box["tokens"] = [o.outputs[0].token_ids for o in outs]

    t = threading.Thread(target=work)
    t.start()
    t.join(timeout=120)
    assert box["tokens"] == ref


def test_capturing_the_lone_sequence_graph_mid_run_keeps_the_caches(checkpoint_factory):
    """The persistent kernel's graph is captured while serving, once its background compile is
    done. That capture must keep the caching allocator: with `torch.cuda.graph`, which empties
    it (and the pinned host cache), the next full-budget step cudaMalloc'd its activations again."""
    path = checkpoint_factory("qwen3", max_position_embeddings=4096)  # a 4,096-token step: see the test above
    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=4096, max_num_batched_tokens=4096,
              max_num_seqs=64, gpu_memory_utilization=0.3)
    runner = llm.engine.executor.runner
    assert runner.fastpath is not None and runner.fastpath.decoder is not None
    # One prefill step of the full token budget and no decode step, so the background compile
    # (started by the first decode step) has not begun.
    llm.generate(prompts(llm.engine.vocab_size, [4000, 96], seed=5), SamplingParams(max_tokens=1), use_tqdm=False)
    assert not runner.fastpath.graphs.has_single
    runner.finish_background_compile()  # compiles and captures the graph now, between steps
    assert runner.fastpath.graphs.has_single
    adopted = torch.cuda.memory_stats()["num_device_alloc"]
    # Other prompts (no prefix-cache hit): a full-budget step again, then decodes.
    outs = llm.generate(prompts(llm.engine.vocab_size, [4000, 96], seed=6),
                        SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    assert torch.cuda.memory_stats()["num_device_alloc"] == adopted


def test_small_batches_pad_to_the_smallest_graph(checkpoint_factory):
    """Batches of 1-7 decodes replay the 8-row graph with padded rows (slot -1, length 0), or,
    with the persistent decode kernel adopted, a lone sequence replays its graph of that kernel
    (nanovllm/fastpath/); the tokens must equal eager mode's as the batch shrinks
    3 -> 2 -> 1."""
    path = checkpoint_factory("qwen3")
    outs = {}
    for mode in ("eager", "graphs", "graphs+persistent"):
        llm = LLM(str(path), device="cuda", dtype="float32", max_model_len=1024, gpu_memory_utilization=0.3,
                  enforce_eager=mode == "eager", persistent_decode=mode == "graphs+persistent")
        runner = llm.engine.executor.runner
        assert (runner.graph_runner is None) == (mode == "eager")
        assert (runner.fastpath is not None) == (mode == "graphs+persistent")
        if mode == "graphs+persistent":
            runner.finish_background_compile()
            counted = CountedGraph(runner.fastpath.graphs.single_graph)
            runner.fastpath.graphs.single_graph = counted
        ps = prompts(llm.engine.vocab_size, [5, 40, 9], seed=3)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (10, 20, 30)]
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    assert [len(t) for t in outs["eager"]] == [10, 20, 30]
    assert outs["graphs"] == outs["eager"]
    assert outs["graphs+persistent"] == outs["eager"]
    assert counted.replays > 0


def test_persistent_kernel_is_adopted_while_serving_and_handles_long_contexts(checkpoint_factory):
    """Serving adopts the background-compiled kernel by itself (no explicit wait), and a lone
    sequence past max_splits x split_tokens cached positions (16 x 64: several tiles per split)
    decodes the same tokens through it as in eager mode."""
    path = checkpoint_factory("qwen3", max_position_embeddings=4096)
    kw = dict(device="cuda", dtype="float32", max_model_len=2048, gpu_memory_utilization=0.3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    eager = LLM(str(path), enforce_eager=True, **kw)
    ps = prompts(eager.engine.vocab_size, [1500], seed=4)
    expected = eager.generate(ps, params, use_tqdm=False)[0].outputs[0].token_ids
    del eager
    llm = LLM(str(path), **kw)
    runner = llm.engine.executor.runner
    deadline = time.monotonic() + 300
    while not runner.fastpath.graphs.has_single:  # each step checks whether the compile is done
        assert time.monotonic() < deadline, "the persistent kernel was never adopted"
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
        time.sleep(0.2)
    counted = LoneSequenceGraphs(runner.fastpath.graphs)
    assert llm.generate(ps, params, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert counted.steps >= 15  # every decode step after the prefill


def test_lone_sequence_graph_feeds_the_sampler_when_not_plain_greedy(checkpoint_factory):
    """The persistent kernel's graph ends in the LM head and a greedy argmax; a lone sequence
    that bans tokens (min_tokens) or asks for logprobs is sampled from the graph's logits
    instead. Tokens must equal eager mode's, logprobs agree to rounding, and so must a greedy
    request that follows with synchronous scheduling (every input token known on the host, so
    the copy overwrites the one the last replay left)."""
    path = checkpoint_factory("qwen3")
    kw = dict(device="cuda", dtype="float32", max_model_len=1024, gpu_memory_utilization=0.3)
    params = [SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=2),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    outs = {}
    for mode in ("eager", "persistent"):
        llm = LLM(str(path), enforce_eager=mode == "eager", persistent_decode=mode == "persistent", **kw)
        runner = llm.engine.executor.runner
        if mode == "persistent":
            runner.finish_background_compile()
            counted = LoneSequenceGraphs(runner.fastpath.graphs)
        ps = prompts(llm.engine.vocab_size, [21, 6], seed=7)
        first = llm.generate([ps[0]], params[0], use_tqdm=False)[0].outputs[0]
        llm.engine.async_scheduling = False
        outs[mode] = [first, llm.generate([ps[1]], params[1], use_tqdm=False)[0].outputs[0]]
    for eager, persistent in zip(outs["eager"], outs["persistent"]):
        assert persistent.token_ids == eager.token_ids
    for eager, persistent in zip(outs["eager"][0].logprobs, outs["persistent"][0].logprobs):
        assert eager.keys() == persistent.keys()
        for token, lp in eager.items():
            assert persistent[token] == pytest.approx(lp, abs=1e-3)
    assert counted.steps >= 2 * 11  # every decode step of both requests


class CountedGraph:
    def __init__(self, graph) -> None:
        self.graph, self.replays = graph, 0

    def replay(self) -> None:
        self.replays += 1
        self.graph.replay()


class CountedBursts:
    """Counts the replays of the decode bursts' graphs (per burst length, two taken in turn);
    filtered: those of the filtered graphs."""

    def __init__(self, lone_graphs, filtered: bool = False) -> None:
        family = "filtered_burst_graphs" if filtered else "burst_graphs"
        self.graphs = {n: [CountedGraph(g) for g in pair] for n, pair in getattr(lone_graphs, family).items()}
        setattr(lone_graphs, family, self.graphs)

    @property
    def replays(self) -> int:
        return sum(g.replays for pair in self.graphs.values() for g in pair)

    @property
    def steps(self) -> int:
        return sum(n * g.replays for n, pair in self.graphs.items() for g in pair)


class LoneSequenceGraphs:
    """Counts the decode steps that the persistent kernel's graphs ran: one per replay of the
    graph of one step, burst_steps per replay of a decode burst's graph."""

    def __init__(self, lone_graphs) -> None:
        self.lone_graphs = lone_graphs
        self.single = lone_graphs.single_graph = CountedGraph(lone_graphs.single_graph)
        self.burst = CountedBursts(lone_graphs)

    @property
    def steps(self) -> int:
        return self.single.replays + self.burst.steps


def test_start_up_leaves_the_largest_step_memory_cached(checkpoint_factory):
    """Graph capture empties the caching allocator; start-up then runs the largest step again so
    that the first full prefill step does not cudaMalloc its activations."""
    # 4,096 tokens: the step's projections are 2 MB tensors, from the allocator's large pool,
    # whose free segments an empty_cache returns (a tiny model's 1,024-token step fits in the
    # small pool's segments that the weights keep alive, and would pass either way).
    path = checkpoint_factory("qwen3", max_position_embeddings=4096)
    # Without the persistent kernel: its graph, captured whenever its background compile is done
    # (possibly during this generate, with a warm Triton cache), allocates its LM head's output.
    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=4096, max_num_batched_tokens=4096,
              max_num_seqs=64, gpu_memory_utilization=0.3, persistent_decode=False)
    assert llm.engine.executor.runner.graph_runner is not None
    mallocs = torch.cuda.memory_stats()["num_device_alloc"]
    ps = prompts(llm.engine.vocab_size, [4000, 96], seed=5)  # one step of the full token budget
    outs = llm.generate(ps, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    assert torch.cuda.memory_stats()["num_device_alloc"] == mallocs


# A small Qwen3 whose projections run on tensor cores in bf16 (the kernel's fused LM head).
TENSOR_CORE_SHAPE = dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32)


def lone_stream_llm(path, dtype: str, burst: int | None) -> LLM:
    """An LLM on the GPU whose lone streams take the fast path (its kernel compiled and its graphs
    captured), in decode bursts of `burst` steps (None: the default)."""
    llm = LLM(str(path), device="cuda", dtype=dtype, max_model_len=1024, gpu_memory_utilization=0.3,
              decode_burst=burst)
    llm.engine.executor.runner.finish_background_compile()
    return llm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_burst_graph_equals_single_steps(checkpoint_factory, dtype):
    """With the persistent kernel adopted, a lone greedy sequence replays the burst graphs (two,
    in turn, each over its own inputs; 8 steps per replay, each step's argmax the next one's
    input, the last one's the other graph's first; the tokens written to pinned host memory by
    the kernel, or read back rotated from the records: CudaGraphRunner.replay_burst); its tokens
    equal one step per replay, across KV-block boundaries, with
    the last tokens of a request in a shorter burst, an EOS inside a burst, and a batch between.
    bf16 takes a shape whose projections run on tensor cores, so the kernel's own LM head and
    argmax (fused_head) feed the next step; fp32 the cuBLAS head and GreedyRow."""
    shape = TENSOR_CORE_SHAPE if dtype == "bfloat16" else {}
    path = checkpoint_factory("qwen3", **shape)
    outs = {}
    for burst in (1, None):
        llm = lone_stream_llm(path, dtype, burst)
        runner = llm.engine.executor.runner
        g = runner.fastpath.graphs
        assert bool(g.burst_graphs) == (burst is None) and runner.decode_burst == (8 if burst is None else 1)
        assert runner.fastpath.decoder.fused_head == (dtype == "bfloat16" and torch.cuda.get_device_capability() >= (9, 0))
        if burst is None:
            counted = CountedBursts(g)
        ps = prompts(llm.engine.vocab_size, [5, 40, 9, 200], seed=4)
        params = SamplingParams(temperature=0, max_tokens=45, ignore_eos=True)
        alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in ps]
        batch = [o.outputs[0].token_ids for o in llm.generate(ps[:2], params, use_tqdm=False)]
        outs[burst] = alone, batch
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    assert outs[None] == outs[1]
    # per prompt: 44 tokens after the prefill's = 5 bursts of 8 and one of 4
    assert sorted(counted.graphs) == [2, 4, 8] and counted.replays >= 4 * 6
    assert all(graph.replays >= 2 * 4 for graph in counted.graphs[8]) and counted.steps >= 4 * 44  # in turn
    assert g.bursts_to_host == (dtype == "bfloat16" and torch.cuda.get_device_capability() >= (9, 0))
    # Not plain greedy (logprobs): single steps whose sampler reads the graph's logits (the
    # kernel's own with fused_head): the same tokens, each the most likely one.
    out = llm.generate([ps[0]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == outs[1][0][0][:20]
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry[token] == max(entry.values())
    ids = outs[1][0][0]
    eos = ids[10]
    llm = LLM(str(path), device="cuda", dtype=dtype, max_model_len=1024, gpu_memory_utilization=0.3, eos=eos)
    llm.engine.executor.runner.finish_background_compile()
    out = llm.generate([ps[0]], SamplingParams(temperature=0, max_tokens=45), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == ids[: ids.index(eos) + 1]


def test_sampled_stream_bursts_in_the_graph_equal_single_steps(checkpoint_factory):
    """A plain-temperature stream alone, with the kernel's own LM head (bf16, tensor cores):
    the graphs sample in the kernel (each record carries the temperature and a seed drawn on
    the host from torch's RNG), so the stream takes bursts of 8 in the burst graphs (one of 4 at
    its end); from the
    same seed its tokens equal one step per replay of the single graph, they are not the greedy
    tokens, and a top-p stream (sampled after the graph, from its logits) takes no burst."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the fused head needs the shared-memory slots (sm_90)")
    path = checkpoint_factory("qwen3", **TENSOR_CORE_SHAPE)
    params = SamplingParams(temperature=1.5, max_tokens=45, ignore_eos=True)
    outs = {}
    for burst in (1, None):
        llm = lone_stream_llm(path, "bfloat16", burst)
        runner = llm.engine.executor.runner
        assert runner.fastpath.lone_sampling
        g = runner.fastpath.graphs
        single = g.single_graph = CountedGraph(g.single_graph)
        if burst is None:
            counted = CountedBursts(g)
        ps = prompts(llm.engine.vocab_size, [5, 40, 200], seed=6)
        outs[burst] = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in ps]
        # 44 tokens after the prefill's: one step per replay, or bursts of 8 and one of 4 (burst_sizes)
        assert single.replays >= 3 * 44 if burst == 1 else (single.replays == 0 and counted.steps == 3 * 44)
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    assert outs[None] == outs[1]
    assert counted.replays >= 3 * 5
    greedy = [llm.generate([p], SamplingParams(temperature=0, max_tokens=45, ignore_eos=True), use_tqdm=False)[0]
              .outputs[0].token_ids for p in ps]
    assert greedy != outs[1]
    before = counted.replays
    out = llm.generate([ps[0]], SamplingParams(temperature=1.5, top_p=0.9, max_tokens=20, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 20 and counted.replays == before  # the filtered graphs took it


@pytest.mark.parametrize("params", [dict(temperature=0.6, top_p=0.95, top_k=20), dict(temperature=1.3, min_p=0.05)],
                         ids=["chat", "min_p"])
def test_seeded_filtered_stream_alone_equals_its_tokens_in_a_batch(checkpoint_factory, params):
    """A seeded top-k / top-p / min-p stream decoding alone takes the filtered graphs (the
    persistent kernel stores every logit, filtered_sampler samples after it) in bursts; its
    tokens equal those of one step per replay, and those of the same request sampled by the
    runner in a batch with other requests (fp32: the kernel's logits and cuBLAS's agree to
    rounding, and the noise is keyed by the seed and the position alone)."""
    path = checkpoint_factory("qwen3", **TENSOR_CORE_SHAPE)
    sp = SamplingParams(**params, seed=11, max_tokens=40, ignore_eos=True)
    outs = {}
    for burst in (1, None):
        llm = lone_stream_llm(path, "float32", burst)
        runner = llm.engine.executor.runner
        g = runner.fastpath.graphs
        assert g.has_filtered
        counted = CountedBursts(g, filtered=True)
        ps = prompts(llm.engine.vocab_size, [5, 60], seed=3)
        outs[burst] = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in ps]
        assert counted.replays > 0 if burst is None else counted.replays == 0
    assert outs[None] == outs[1]
    others = prompts(llm.engine.vocab_size, [9, 30, 70], seed=4)
    batch = llm.generate(ps + others, [sp, sp] + [SamplingParams(temperature=1.0, max_tokens=40)] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batch[:2]] == outs[None]
    assert len(set(map(tuple, outs[None]))) == 2 and all(len(t) == 40 for t in outs[None])


def test_seeded_top_k_stream_on_the_int8_heads_bounds_draws_the_16_bit_heads_tokens(checkpoint_factory):
    """A bf16 seeded top-k stream (Qwen3's defaults) decoding alone takes the int8 head's bounds
    and the exact recompute of its top rows (fastpath/head_refine.py) instead of the 16-bit LM
    head; its tokens equal those of the same stream through the 16-bit head, in bursts and in
    one step per replay; a top-p-only stream (no top k) keeps the 16-bit head."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the persistent kernel's int8 head needs sm_90")
    path = checkpoint_factory("qwen3", **TENSOR_CORE_SHAPE)
    chat = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, seed=11, max_tokens=40, ignore_eos=True)
    for burst in (1, None):
        llm = lone_stream_llm(path, "bfloat16", burst)
        runner = llm.engine.executor.runner
        fp = runner.fastpath
        assert fp.graphs.has_filtered and fp.graphs.has_top_k and fp.decoder.quantized_head
        asked = []
        suffice = fp._bounds_suffice
        fp._bounds_suffice = lambda p: asked.append(suffice(p)) or asked[-1]
        ps = prompts(llm.engine.vocab_size, [5, 60], seed=3)
        on_bounds = [llm.generate([p], chat, use_tqdm=False)[0].outputs[0].token_ids for p in ps]
        assert asked and all(asked)
        fp._bounds_suffice = lambda p: False
        on_16_bit = [llm.generate([p], chat, use_tqdm=False)[0].outputs[0].token_ids for p in ps]
        assert on_bounds == on_16_bit and all(len(t) == 40 for t in on_bounds)
        assert len(set(map(tuple, on_bounds))) == 2
        assert not suffice(SamplingParams(temperature=0.6, top_p=0.95))


PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={5: 1.0, 6: -100.0})


@pytest.mark.parametrize("params", [dict(temperature=0.6, top_p=0.95, top_k=20), dict(temperature=0)],
                         ids=["chat", "greedy"])
def test_seeded_penalized_stream_alone_equals_its_tokens_in_a_batch(checkpoint_factory, params):
    """A seeded stream with presence, frequency and repetition penalties and a logit bias
    decoding alone takes the filtered graphs (the penalty kernel edits the stored logits and
    counts each sampled token on the device: fastpath/penalties.py), in bursts and in one step
    per replay alike; its tokens equal those of the same request sampled by the runner's per-op
    penalties in a batch (fp32), also where it moves from the fast path to a batch and back
    (its token counts written back and loaded again), and the penalties change them."""
    path = checkpoint_factory("qwen3", **TENSOR_CORE_SHAPE)
    sp = SamplingParams(**params, **PENALTIES, seed=11, max_tokens=40, ignore_eos=True)
    outs = {}
    for burst in (1, None):
        llm = lone_stream_llm(path, "float32", burst)
        runner = llm.engine.executor.runner
        g = runner.fastpath.graphs
        assert g.has_filtered
        counted = CountedBursts(g, filtered=True)
        single = g.filtered_single_graph = CountedGraph(g.filtered_single_graph)
        ps = prompts(llm.engine.vocab_size, [5, 60], seed=3)
        outs[burst] = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in ps]
        assert counted.replays > 0 if burst is None else (counted.replays == 0 and single.replays >= 2 * 30)
    assert outs[None] == outs[1] and all(len(t) == 40 for t in outs[None])
    others = prompts(llm.engine.vocab_size, [9, 30, 70], seed=4)
    plain = SamplingParams(temperature=1.0, max_tokens=40)
    batch = llm.generate(ps + others, [sp, sp] + [plain] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batch[:2]] == outs[None]
    # Alone (fast path, bursts), then in a batch (per-op) while another request runs, then alone again.
    engine = llm.engine
    before = counted.replays
    engine.add_request("lone", ps[0], sp)
    for _ in range(3):  # its prefill and a burst or two
        engine.step()
    engine.add_request("guest", others[0], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    assert final["lone"] == outs[None][0] and len(final["guest"]) == 12 and counted.replays > before
    unpenalized = llm.generate([ps[0]], SamplingParams(**params, seed=11, max_tokens=40, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].token_ids
    assert unpenalized != outs[None][0]


def test_lone_stream_with_allowed_ids_or_bad_words_keeps_them_with_the_persistent_kernel(checkpoint_factory):
    """The persistent kernel's graphs pick a lone greedy stream's token themselves; a stream
    with allowed_token_ids or bad_words must take the runner's sampler instead: its tokens
    equal eager mode's, stay within the allowed ids, and never complete a bad word."""
    path = checkpoint_factory("qwen3")
    kw = dict(device="cuda", dtype="float32", max_model_len=1024, gpu_memory_utilization=0.3)
    outs = {}
    for mode in ("eager", "persistent"):
        llm = LLM(str(path), enforce_eager=mode == "eager", persistent_decode=mode == "persistent", **kw)
        if mode == "persistent":
            llm.engine.executor.runner.finish_background_compile()
        prompt = prompts(llm.engine.vocab_size, [19], seed=3)[0]
        plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids
        allowed = sorted(set(range(3, 40)) - set(plain))[:5]
        # A two-token word that the output holds, as the engine tokenizes it.
        word = next(text for i in range(len(plain) - 1) if (text := llm.tokenizer.decode(plain[i:i + 2])).strip()
                    and plain[i:i + 2] in llm.engine.bad_words_token_ids([text]))
        restricted = llm.generate([prompt], [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                            allowed_token_ids=allowed)], use_tqdm=False)
        banned = llm.generate([prompt], [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                        bad_words=[word])], use_tqdm=False)
        outs[mode] = (plain, restricted[0].outputs[0].token_ids, banned[0].outputs[0].token_ids, allowed,
                      llm.engine.bad_words_token_ids([word]))
    assert outs["persistent"][:3] == outs["eager"][:3]
    plain, restricted, banned, allowed, words = outs["persistent"]
    assert set(restricted) <= set(allowed)
    for word_ids in words:
        assert all(banned[i:i + len(word_ids)] != word_ids for i in range(len(banned)))
    assert banned != plain


def test_prompt_logprobs_on_the_gpu_match_transformers(checkpoint_factory):
    """Prompt logprobs on CUDA (graphs on, the persistent kernel adopted, the prompt in chunks,
    beside a plain request): each prompt token's logprob and the top 3 at its position equal
    transformers' log_softmax of the same model's logits, and the plain request's tokens are
    those it gets alone."""
    from transformers import AutoModelForCausalLM

    path = checkpoint_factory("qwen3")
    llm = LLM(str(path), device="cuda", dtype="float32", max_model_len=1024, gpu_memory_utilization=0.3,
              max_num_batched_tokens=64)
    llm.engine.executor.runner.finish_background_compile()
    prompt, other = prompts(llm.engine.vocab_size, [150, 9], seed=11)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate([other], plain, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate([prompt, other], [SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3), plain],
                        use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt], device="cuda")).logits[0].float(), -1).cpu()
    scored = outs[0].prompt_logprobs
    assert len(scored) == len(prompt) and scored[0] is None
    for j in range(1, len(prompt)):
        row, token = ref[j - 1], prompt[j]
        assert scored[j][token] == pytest.approx(row[token].item(), abs=2e-3)
        top = torch.topk(row, 3)
        for t, lp in zip(top.indices.tolist(), top.values.tolist()):
            if lp - 2e-3 > row[top.indices[-1]].item() + 2e-3 or t in scored[j]:  # clear of a near-tie at the cut
                assert scored[j][t] == pytest.approx(lp, abs=2e-3)
