"""The compiled single-sequence decode on the CPU (runner/cpu_compiled_decode.py,
`LLM(cpu_compile=True)`) against the eager model, its reference.

A step in which every sequence decodes one token runs the compiled step; a step with a prefill
runs the eager model. A model shape's first compiled step compiles (seconds on a small
machine); the tests share the compiled packages through the session's cache directory.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanovllm import LLM, SamplingParams

# The second prompt's context crosses several KV blocks (16 positions each) while it decodes.
PROMPTS = [[1, 5, 9, 13, 2, 7], list(range(3, 43))]


def _count_compiled_steps(llm: LLM) -> list[int]:
    decode = llm.engine.executor.runner.cpu_decode
    calls = [0]
    compiled = decode._compiled  # looked up once per compiled step

    def counted(*args):
        calls[0] += 1
        return compiled(*args)

    decode._compiled = counted
    return calls


BUILD_INT4 = ("import sys; from nanovllm import LLM\n"
              "LLM(sys.argv[1], device='cpu', num_kvcache_blocks=16, cpu_compile=True, quantization='int4').shutdown()\n")


@pytest.fixture(scope="module")
def int4_built_beside(checkpoint_factory):
    """The int4 llama model's packages, built into the session's cache by a process of its own
    that starts with the first test here: a build keeps one core busy, so they build while this
    process builds the fp32 models'. Returns wait(), which returns once that process has ended
    (had it failed, the int4 engine here would build them itself)."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", BUILD_INT4, str(checkpoint_factory("llama"))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    yield lambda: proc.wait(timeout=600)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("arch, shape, kwargs", [
    pytest.param("qwen3", {}, {}, id="qwen3-fp32-qk-norm"),
    pytest.param("qwen2", {"head_dim": 16}, {}, id="qwen2-fp32-qkv-bias"),
    pytest.param("llama", {}, {"quantization": "int4"}, id="llama-int4"),
])
def test_compiled_decode_gives_the_eager_models_tokens(checkpoint_factory, int4_built_beside, arch, shape, kwargs):
    path = checkpoint_factory(arch, **shape)
    if kwargs.get("quantization") == "int4":
        int4_built_beside()
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    eager = LLM(path, device="cpu", num_kvcache_blocks=16, **kwargs)
    compiled = LLM(path, device="cpu", num_kvcache_blocks=16, cpu_compile=True, **kwargs)
    calls = _count_compiled_steps(compiled)
    for prompt in PROMPTS:  # one sequence at a time: its decode steps take the compiled step
        want = eager.generate([prompt], sp, use_tqdm=False)[0]["token_ids"]
        got = compiled.generate([prompt], sp, use_tqdm=False)[0]["token_ids"]
        assert got == want
    assert calls[0] == 2 * 19  # every decode step after each prompt's first token
    # Two sequences at once (contexts of different lengths in one step) decode compiled too,
    # with the eager model's tokens.
    both = compiled.generate(PROMPTS, sp, use_tqdm=False)
    assert [o["token_ids"] for o in both] == [o["token_ids"] for o in eager.generate(PROMPTS, sp, use_tqdm=False)]
    assert calls[0] == 3 * 19


def test_compiled_decode_hidden_states_match_the_eager_forward(checkpoint_factory):
    """One decode step's final hidden state from both paths, on the same cache contents."""
    llm = LLM(checkpoint_factory("qwen3"), device="cpu", num_kvcache_blocks=16, cpu_compile=True)
    runner = llm.engine.executor.runner
    from nanovllm.attention.metadata import AttentionMetadata

    prompt = torch.tensor(PROMPTS[1])
    n = len(prompt)
    table = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    prefill = AttentionMetadata(
        slot_mapping=torch.arange(n), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32), block_tables=table, num_decodes=0,
        max_query_len=n, max_seq_len=n, query_lens_cpu=[n], seq_lens_cpu=[n],
    )

    def decode_meta():
        return AttentionMetadata(
            slot_mapping=torch.tensor([n]), query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens=torch.tensor([n + 1], dtype=torch.int32), block_tables=table, num_decodes=1,
            max_query_len=1, max_seq_len=n + 1, query_lens_cpu=[1], seq_lens_cpu=[n + 1],
        )

    token, position = torch.tensor([17]), torch.tensor([n])
    with torch.inference_mode():
        runner.model(prompt, torch.arange(n), prefill)
        want = runner.model(token, position, decode_meta())
        k_after_eager = runner.k_caches[0][n // 16, n % 16].clone()
        got = runner.cpu_decode(token, position, decode_meta())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(runner.k_caches[0][n // 16, n % 16], k_after_eager, atol=1e-6, rtol=1e-6)


def test_shutdown_removes_what_the_loaded_packages_unpacked(checkpoint_factory, monkeypatch, tmp_path):
    """A loaded package unpacks into the temporary directory; a process that ends with
    os._exit after shutdown (the CLI, the engine core) must not leave that behind."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    llm = LLM(checkpoint_factory("qwen3"), device="cpu", num_kvcache_blocks=16, cpu_compile=True)
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert list(tmp_path.glob("aotinductor_*"))
    llm.shutdown()
    assert not list(tmp_path.glob("aotinductor_*"))


@pytest.mark.parametrize("kwargs, message", [
    (dict(device="cuda"), "cpu_compile"),
    (dict(tensor_parallel_size=2), "cpu_compile"),
    (dict(cpu_compile="yes"), "cpu_compile"),
])
def test_bad_cpu_compile_settings_are_refused(qwen3_tiny, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(qwen3_tiny, **({"cpu_compile": True} | kwargs))


def test_a_cpu_engine_left_to_choose_decodes_compiled(checkpoint_factory, monkeypatch):
    """cpu_compile=None (the default) on the CPU, with no NANOVLLM_CPU_COMPILE: the compiled
    decode where a C++ compiler is found, with the eager model's tokens; the environment's 0
    turns it off."""
    path = checkpoint_factory("qwen3")
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    monkeypatch.setenv("NANOVLLM_CPU_COMPILE", "0")
    eager = LLM(path, device="cpu", num_kvcache_blocks=16)
    assert eager.engine.executor.runner.cpu_decode is None
    want = [o["token_ids"] for o in eager.generate(PROMPTS, sp, use_tqdm=False)]
    eager.shutdown()
    monkeypatch.delenv("NANOVLLM_CPU_COMPILE")
    llm = LLM(path, device="cpu", num_kvcache_blocks=16)
    calls = _count_compiled_steps(llm)
    assert [o["token_ids"] for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == want
    assert calls[0] == 7  # every step after the prompts' (both sequences decode together)


def test_a_lone_sequence_decodes_in_bursts_with_the_eager_tokens(checkpoint_factory):
    """With the compiled decode and decode_burst left to the engine, a lone sequence decodes
    several tokens per engine step (fewer near max_tokens), with the eager model's tokens."""
    path = checkpoint_factory("qwen3")
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    eager = LLM(path, device="cpu", num_kvcache_blocks=16)
    want = eager.generate([PROMPTS[1]], sp, use_tqdm=False)[0]["token_ids"]
    eager.shutdown()
    llm = LLM(path, device="cpu", num_kvcache_blocks=16, cpu_compile=True)
    scheduler = llm.engine.scheduler
    schedule, bursts = scheduler.schedule, []

    def recorded(*args):
        out = schedule(*args)
        bursts.extend(s.num_steps for s in out.seqs)
        return out

    scheduler.schedule = recorded
    assert llm.generate([PROMPTS[1]], sp, use_tqdm=False)[0]["token_ids"] == want
    assert bursts == [1, 8, 8, 2, 1]  # the prompt's step, then 19 tokens: 8 + 8 + 2 + 1


def test_without_a_cpp_compiler_the_default_decodes_eager(checkpoint_factory, monkeypatch):
    from torch._inductor import cpp_builder

    def no_compiler():
        raise RuntimeError("no C++ compiler")

    monkeypatch.delenv("NANOVLLM_CPU_COMPILE")
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    llm = LLM(checkpoint_factory("qwen3"), device="cpu", num_kvcache_blocks=16)
    assert llm.engine.executor.runner.cpu_decode is None
    assert len(llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3), use_tqdm=False)[0]["token_ids"]) == 3


def test_a_failed_build_falls_back_to_eager_only_where_not_asked_for(checkpoint_factory, monkeypatch, caplog):
    """A package that cannot be built: the default engine warns and decodes with the eager
    model (the same tokens); cpu_compile=True fails with the build's error."""
    from nanovllm.runner import cpu_compiled_decode

    def broken(*args, **kwargs):
        raise RuntimeError("the C++ compiler failed")

    path = checkpoint_factory("qwen3")
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eager = LLM(path, device="cpu", num_kvcache_blocks=16)
    want = eager.generate([PROMPTS[1]], sp, use_tqdm=False)[0]["token_ids"]
    eager.shutdown()
    monkeypatch.delenv("NANOVLLM_CPU_COMPILE")
    monkeypatch.setattr(cpu_compiled_decode, "aot_package", broken)
    with caplog.at_level("WARNING", logger="nanovllm"):
        llm = LLM(path, device="cpu", num_kvcache_blocks=16)
    assert llm.engine.executor.runner.cpu_decode is None
    assert "the C++ compiler failed" in caplog.text
    assert llm.generate([PROMPTS[1]], sp, use_tqdm=False)[0]["token_ids"] == want
    llm.shutdown()
    with pytest.raises(RuntimeError, match="the C\\+\\+ compiler failed"):
        LLM(path, device="cpu", num_kvcache_blocks=16, cpu_compile=True)


def test_a_bad_environment_choice_is_refused(qwen3_tiny, monkeypatch):
    monkeypatch.setenv("NANOVLLM_CPU_COMPILE", "yes")
    with pytest.raises(ValueError, match="NANOVLLM_CPU_COMPILE"):
        LLM(qwen3_tiny, device="cpu")


def test_a_mixture_of_experts_model_is_refused(checkpoint_factory, monkeypatch):
    """Asked for, the compiled decode refuses a model it does not cover; left to choose, the
    engine decodes that model with the eager one."""
    path = checkpoint_factory("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        LLM(path, device="cpu", num_kvcache_blocks=16, cpu_compile=True)
    monkeypatch.delenv("NANOVLLM_CPU_COMPILE")
    assert LLM(path, device="cpu", num_kvcache_blocks=16).engine.executor.runner.cpu_decode is None


def test_a_model_whose_layers_differ_in_shape_is_not_covered(qwen3_tiny):
    """One package serves every layer, so a layer unlike the others makes the model uncovered
    (left to choose, its engine decodes eagerly; asked for, the compiled decode refuses it)."""
    from torch import nn

    from nanovllm.runner.cpu_compiled_decode import unsupported_reason

    model = LLM(qwen3_tiny, device="cpu", num_kvcache_blocks=16).engine.executor.runner.model
    assert unsupported_reason(model) is None
    o_proj = model.model.layers[1].self_attn.o_proj
    o_proj.weight = nn.Parameter(o_proj.weight.detach().double(), requires_grad=False)
    assert "differ in shape" in unsupported_reason(model)


def test_compiled_int8_head_gives_the_heads_logits(checkpoint_factory):
    """Where the head's int8 kernel is torch's reference one (no FBGEMM), a lone row's logits
    come from one compiled reduction over the codes: the reference kernel's logits up to one
    bf16 rounding (the sums run in another order)."""
    from nanovllm.layers.int8_head import Int8HeadMatmul

    llm = LLM(checkpoint_factory("llama"), device="cpu", num_kvcache_blocks=16, quantization="int4", cpu_compile=True)
    runner = llm.engine.executor.runner
    head = runner.model.lm_head
    head.int8 = Int8HeadMatmul(head.int8.codes, head.int8.scales_bf16.float(), use_fbgemm=False)
    hidden = torch.randn(1, head.weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = head.int8(hidden.bfloat16())
        got = runner.cpu_decode.compute_logits(hidden.bfloat16())
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)


def test_steps_of_many_rows_decode_compiled_through_the_int4_dense_copies(checkpoint_factory, monkeypatch):
    """With dense bf16 copies of the int4 weights (forced here), decode steps of DENSE_MIN_ROWS
    sequences or more run the compiled layer over the copies (as the eager layers multiply them
    at that size), smaller ones over the codes. Over the codes the tokens are the eager model's;
    over the copies a bf16 product may round its last bit otherwise than eager torch's, so the
    step's hidden states are compared with the eager forward's on the same cache contents."""
    from nanovllm.attention.metadata import AttentionMetadata
    from nanovllm.layers.int4_linear import DENSE_MIN_ROWS
    from nanovllm.runner import model_runner

    monkeypatch.setattr(model_runner, "int4_dense_copies", lambda hf_config: True)
    path = checkpoint_factory("llama")
    prompts = [[(7 * i + j) % 200 + 3 for j in range(4 + i % 5)] for i in range(DENSE_MIN_ROWS)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eager = LLM(path, device="cpu", num_kvcache_blocks=64, quantization="int4")
    want = [o["token_ids"] for o in eager.generate(prompts[:3], sp, use_tqdm=False)]
    eager.shutdown()
    llm = LLM(path, device="cpu", num_kvcache_blocks=80, quantization="int4", cpu_compile=True)
    decode = llm.engine.executor.runner.cpu_decode
    variants = []
    compiled = decode._compiled

    def recorded(variant, *args):
        variants.append(variant)
        return compiled(variant, *args)

    decode._compiled = recorded
    assert len(llm.generate(prompts, sp, use_tqdm=False)) == DENSE_MIN_ROWS
    assert variants and all(variant == (True, True) for variant in variants)  # (batched, dense)
    variants.clear()
    assert [o["token_ids"] for o in llm.generate(prompts[:3], sp, use_tqdm=False)] == want
    assert variants and all(variant == (True, False) for variant in variants)

    # One step of DENSE_MIN_ROWS sequences (5 cached positions each, blocks 2r and 2r + 1).
    rows, n, runner = DENSE_MIN_ROWS, 5, llm.engine.executor.runner
    table = torch.arange(2 * rows, dtype=torch.int32).view(rows, 2)
    prefill = AttentionMetadata(
        slot_mapping=torch.cat([torch.arange(n) + 32 * r for r in range(rows)]),
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32) * n, seq_lens=torch.full((rows,), n, dtype=torch.int32),
        block_tables=table, num_decodes=0, max_query_len=n, max_seq_len=n, query_lens_cpu=[n] * rows, seq_lens_cpu=[n] * rows,
    )

    def decode_meta():
        return AttentionMetadata(
            slot_mapping=torch.arange(rows) * 32 + n, query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
            seq_lens=torch.full((rows,), n + 1, dtype=torch.int32), block_tables=table, num_decodes=rows,
            max_query_len=1, max_seq_len=n + 1, query_lens_cpu=[1] * rows, seq_lens_cpu=[n + 1] * rows,
        )

    tokens, positions = torch.arange(rows) * 5 + 3, torch.full((rows,), n)
    with torch.inference_mode():
        runner.model(torch.tensor([t for p in prompts for t in (p * 2)[:n]]), torch.arange(n).repeat(rows), prefill)
        want_hidden = runner.model(tokens, positions, decode_meta())
        got_hidden = runner.cpu_decode(tokens, positions, decode_meta())
    assert variants[-1] == (True, True)
    torch.testing.assert_close(got_hidden, want_hidden, atol=2e-2, rtol=1.6e-2)  # bf16: a rounding or two


def test_a_later_engine_loads_the_compiled_step_from_the_cache(checkpoint_factory, monkeypatch):
    """The compiled step is built once per model shape: a later engine (another process, in
    use) loads the package from the cache directory and exports nothing."""
    path = checkpoint_factory("qwen3")
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = LLM(path, device="cpu", num_kvcache_blocks=16, cpu_compile=True)
    want = first.generate([PROMPTS[0]], sp, use_tqdm=False)[0]["token_ids"]
    first.shutdown()

    def no_export(*args, **kwargs):
        raise AssertionError("the decode step was exported again")

    monkeypatch.setattr(torch.export, "export", no_export)
    again = LLM(path, device="cpu", num_kvcache_blocks=32, cpu_compile=True)  # another pool size: a dynamic dimension
    assert again.generate([PROMPTS[0]], sp, use_tqdm=False)[0]["token_ids"] == want


def test_packages_are_built_at_start_up_and_drop_those_of_other_code(checkpoint_factory, monkeypatch, tmp_path):
    """An engine prepares every variant's package when it starts (a lone sequence, batches),
    building the one its cache lacks, so no request waits for one; they live under a directory
    per code version (torch's, this module's), and building one removes the other versions'
    directories, which nothing loads again. The cache starts with the batched package (copied
    from the session's cache) and an older version's directory."""
    import shutil

    import torch._inductor

    path = checkpoint_factory("qwen3")
    loaded = []  # the session cache's packages, in the order the start-up loads them
    load = torch._inductor.aoti_load_package
    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda package: loaded.append(package) or load(package))
    LLM(path, device="cpu", num_kvcache_blocks=16, cpu_compile=True).shutdown()
    batched = Path(loaded[-1])  # variant_rows: the one-row variant first
    monkeypatch.setenv("NANOVLLM_CACHE_DIR", str(tmp_path))
    (tmp_path / "cpu-decode" / batched.parent.name).mkdir(parents=True)
    shutil.copy(batched, tmp_path / "cpu-decode" / batched.parent.name / batched.name)
    stale = tmp_path / "cpu-decode" / "0123456789abcdef"
    stale.mkdir(parents=True)
    (stale / "old.pt2").write_bytes(b"an older version's package")
    eager = LLM(path, device="cpu", num_kvcache_blocks=16)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = [o["token_ids"] for o in eager.generate(PROMPTS, sp, use_tqdm=False)]
    eager.shutdown()
    exports = []
    export = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *args, **kwargs: exports.append(1) or export(*args, **kwargs))
    llm = LLM(path, device="cpu", num_kvcache_blocks=16, cpu_compile=True)
    assert len(exports) == 1  # the one-row variant's build
    assert set(llm.engine.executor.runner.cpu_decode.compiled) == {(False, False), (True, False)}
    assert not stale.exists()
    assert len(list((tmp_path / "cpu-decode").glob("*/*.pt2"))) == 2  # the one-row and the batched variants

    def no_export(*args, **kwargs):
        raise AssertionError("a request waited for a build")

    monkeypatch.setattr(torch.export, "export", no_export)
    assert [o["token_ids"] for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == want
    assert llm.generate([PROMPTS[0]], sp, use_tqdm=False)[0]["token_ids"] == want[0]


@pytest.mark.parametrize("arch, kwargs", [
    pytest.param("qwen3", {}, id="fp32"),
    pytest.param("llama", {"quantization": "int4"}, id="int4"),
])
def test_decodes_beside_a_prompt_decode_compiled_and_give_the_eager_tokens(checkpoint_factory, monkeypatch, arch, kwargs):
    """A step that carries a prompt (or a chunk of one) beside decoding sequences runs the
    decodes through the compiled step and the prompt through the eager model; every sequence's
    tokens are the eager engine's under the same arrivals. (The models are those of
    test_compiled_decode_gives_the_eager_models_tokens, whose packages the cache holds.)"""
    from nanovllm.runner import model_runner

    path = checkpoint_factory(arch)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    arrivals = {0: [PROMPTS[1], PROMPTS[0]], 3: [list(range(50, 90))], 5: [[4, 8, 15, 16, 23, 42]]}

    def run(llm: LLM) -> dict[str, list[int]]:
        engine, tokens, step = llm.engine, {}, 0
        while step in arrivals or engine.has_unfinished_requests() or step < max(arrivals):
            for i, prompt in enumerate(arrivals.get(step, [])):
                engine.add_request(f"{step}-{i}", prompt, sp)
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
            step += 1
        return tokens

    eager = LLM(path, device="cpu", num_kvcache_blocks=32, max_num_batched_tokens=64, **kwargs)
    want = run(eager)
    eager.shutdown()
    splits = []
    split = model_runner.split_decodes
    monkeypatch.setattr(model_runner, "split_decodes", lambda meta: splits.append(meta.num_decodes) or split(meta))
    llm = LLM(path, device="cpu", num_kvcache_blocks=32, max_num_batched_tokens=64, cpu_compile=True, **kwargs)
    assert run(llm) == want
    assert splits  # some steps had decodes beside a prompt
    assert all(len(t) == 12 for t in want.values()) and len(want) == 4


def test_a_cache_that_cannot_be_written_still_gets_a_compiled_step(checkpoint_factory, monkeypatch, tmp_path, caplog):
    """cpu_compile=True with a cache directory that cannot be made (its parent is a file): the
    step is built in a temporary directory and not kept, with a warning, and decodes the eager
    model's tokens (the engine used to fail to start). A lone sequence decodes here, so the
    engine builds the one-row variant only."""
    from nanovllm.runner.cpu_compiled_decode import CompiledCpuDecode

    monkeypatch.setattr(CompiledCpuDecode, "variant_rows", lambda self: [1])
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("NANOVLLM_CACHE_DIR", str(blocker / "cache"))
    path = checkpoint_factory("qwen3")
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    eager = LLM(path, device="cpu", num_kvcache_blocks=16, cpu_compile=False)
    want = eager.generate([PROMPTS[0]], sp, use_tqdm=False)[0]["token_ids"]
    eager.shutdown()
    with caplog.at_level(logging.WARNING, logger="nanovllm"):
        llm = LLM(path, device="cpu", num_kvcache_blocks=16, cpu_compile=True)
    assert llm.engine.executor.runner.cpu_decode is not None
    assert "cannot be written" in caplog.text
    assert llm.generate([PROMPTS[0]], sp, use_tqdm=False)[0]["token_ids"] == want
