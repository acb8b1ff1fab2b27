"""Parallel Triton compilation at start-up (nanovllm/precompile.py).

On the CPU: `launch` runs a kernel normally and only queues its compilation inside
`precompiling()`, with Triton's async compile mode active there and nowhere else. On a CUDA
device (skipped elsewhere, with the reason shown): in a fresh process, every kernel compiled
while `LLM()` starts is compiled by the dry pass, and serving a mixed workload afterwards
compiles nothing.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from nanovllm.precompile import launch, precompiling


class RecordingKernel:
    """Stands in for a Triton JITFunction: records launches (kernel[grid](...)) and warmups."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(("run", grid, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.calls.append(("warmup", grid, args, kwargs))


def async_mode_active() -> bool:
    from triton.runtime import _async_compile

    return _async_compile.active_mode.get() is not None


def test_launch_runs_the_kernel_outside_precompiling():
    kernel = RecordingKernel()
    launch(kernel, (3, 2), "x", 7, BLOCK=16, num_warps=4)
    assert kernel.calls == [("run", (3, 2), ("x", 7), {"BLOCK": 16, "num_warps": 4})]


def test_launch_only_queues_compilation_inside_precompiling():
    pytest.importorskip("triton.runtime._async_compile", reason="this Triton has no async compile mode")
    kernel = RecordingKernel()
    with precompiling(max_workers=2) as dry:
        assert dry is True
        assert async_mode_active()
        launch(kernel, (5,), "y", BLOCK=32)
    assert kernel.calls == [("warmup", (5,), ("y",), {"BLOCK": 32})]
    assert not async_mode_active()
    launch(kernel, (5,), "y", BLOCK=32)
    assert kernel.calls[-1][0] == "run"


def test_a_dry_pass_hands_each_distinct_launch_to_triton_once():
    pytest.importorskip("triton.runtime._async_compile", reason="this Triton has no async compile mode")
    kernel, other = RecordingKernel(), RecordingKernel()
    x32 = torch.zeros(64, dtype=torch.float32)
    y32 = torch.ones(64, dtype=torch.float32)  # another tensor, same dtype and alignment as x32
    with precompiling(max_workers=1):
        for _ in range(28):  # a model's identical layers
            launch(kernel, (4,), x32, 8, BLOCK=16)
        launch(kernel, (9,), y32, 8, BLOCK=16)  # only the grid differs: not a new variant
        launch(kernel, (4,), x32.half(), 8, BLOCK=16)  # dtype
        launch(kernel, (4,), x32[1:], 8, BLOCK=16)  # 4-byte offset: alignment
        launch(kernel, (4,), x32, 9, BLOCK=16)  # an int's value
        launch(kernel, (4,), x32, 8, BLOCK=32)  # a constexpr
        launch(other, (4,), x32, 8, BLOCK=16)  # another kernel
    assert [c[0] for c in kernel.calls] == ["warmup"] * 5
    assert [c[0] for c in other.calls] == ["warmup"]
    with precompiling(max_workers=1):  # each dry pass starts afresh
        launch(kernel, (4,), x32, 8, BLOCK=16)
    assert len(kernel.calls) == 6


def test_the_launcher_is_built_once_the_queued_compile_is_done():
    from concurrent.futures import Future
    from types import SimpleNamespace

    from nanovllm.precompile import _when_compiled

    built = []
    ok, failed = SimpleNamespace(future=Future()), SimpleNamespace(future=Future())
    _when_compiled(ok, built.append)
    _when_compiled(failed, built.append)
    _when_compiled(object(), built.append)  # already compiled in this process: nothing queued
    assert built == []
    ok.future.set_result("compiled kernel")
    failed.future.set_exception(RuntimeError("compile failed"))
    assert built == ["compiled kernel"]


def test_precompiling_ends_on_an_exception():
    pytest.importorskip("triton.runtime._async_compile", reason="this Triton has no async compile mode")
    kernel = RecordingKernel()
    with pytest.raises(RuntimeError, match="dry pass failed"):
        with precompiling(max_workers=1):
            raise RuntimeError("dry pass failed")
    assert not async_mode_active()
    launch(kernel, (1,))
    assert kernel.calls == [("run", (1,), (), {})]


def test_compile_in_background_queues_launches_on_its_own_thread():
    import threading

    from nanovllm.precompile import compile_in_background

    pytest.importorskip("triton.runtime._async_compile", reason="this Triton has no async compile mode")
    kernel, threads = RecordingKernel(), []

    def dry_pass():
        threads.append(threading.current_thread())
        launch(kernel, (2,), "z", BLOCK=8)

    assert compile_in_background(dry_pass).result(timeout=60) is True
    assert threads[0] is not threading.current_thread() and not threads[0].daemon
    assert kernel.calls == [("warmup", (2,), ("z",), {"BLOCK": 8})]
    assert not async_mode_active()  # the caller's thread never entered the dry pass
    launch(kernel, (2,), "z", BLOCK=8)
    assert kernel.calls[-1][0] == "run"

    def broken():
        raise RuntimeError("dry pass failed")

    with pytest.raises(RuntimeError, match="dry pass failed"):
        compile_in_background(broken).result(timeout=60)


# Runs in a fresh process (empty in-memory kernel caches): records every compile Triton starts,
# and whether it came from a warmup (the dry pass) or from a real launch.
_COMPILE_LOG_SCRIPT = textwrap.dedent(
    """
    import json, random, sys
    import triton
    from nanovllm import LLM, SamplingParams
    from nanovllm.sampling_params import StructuredOutputsParams

    events = []

    def hook(*, fn, is_manual_warmup, **_):
        events.append((fn.name, bool(is_manual_warmup)))
        return False  # compile as usual

    triton.knobs.runtime.jit_cache_hook = hook
    llm = LLM(sys.argv[1], device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=64,
              max_num_batched_tokens=256, gpu_memory_utilization=0.3)
    at_start = list(events)
    rng = random.Random(0)
    vocab = llm.engine.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 300))] for _ in range(48)]
    prompts += [prompts[0] + [5, 6, 7]]  # a prefix-cache hit
    params = [SamplingParams(temperature=[0.0, 1.0, 0.7][i % 3], top_k=[-1, 20][i % 2], seed=i if i % 5 == 0 else None,
                             max_tokens=rng.randrange(1, 40), ignore_eos=True) for i in range(len(prompts))]
    llm.generate(prompts, params, use_tqdm=False)  # chunked prefills, mixed steps, decodes of 1..49 rows
    llm.generate(prompts[:3], SamplingParams(temperature=1.0, max_tokens=8), use_tqdm=False)
    llm.engine.executor.runner.finish_background_compile()
    llm.generate(prompts[:1], SamplingParams(max_tokens=8), use_tqdm=False)  # a lone decode: the kernel's graph
    # 40 new sequences under one grammar sample in one step, every row under its mask: the
    # fused sampler's masked variant (40 rows: more than Sampler.fast_path_min_rows).
    grammar = SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json_object=True))
    llm.generate([[5 + i, 6, 7] for i in range(40)], grammar, use_tqdm=False)
    # Greedy rows under their masks, a few: the masked argmax (Sampler.greedy).
    greedy = SamplingParams(temperature=0.0, max_tokens=2, structured_outputs=StructuredOutputsParams(json_object=True))
    llm.generate([[9 + i, 6, 7] for i in range(5)], greedy, use_tqdm=False)
    print(json.dumps({"start": at_start, "serving": events[len(at_start):]}))
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_start_up_compiles_every_kernel_in_the_dry_pass(qwen3_tiny, tmp_path):
    import triton

    if not hasattr(triton, "knobs") or not hasattr(triton.knobs.runtime, "jit_cache_hook"):
        pytest.skip("this Triton has no jit_cache_hook to observe compiles")
    pytest.importorskip("triton.runtime._async_compile", reason="this Triton has no async compile mode")
    script = tmp_path / "compile_log.py"
    script.write_text(_COMPILE_LOG_SCRIPT)
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))  # an empty cache: a machine's first start
    proc = subprocess.run([sys.executable, str(script), str(qwen3_tiny)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = json.loads(proc.stdout.strip().splitlines()[-1])
    start = log["start"]
    assert start, "no kernel was compiled at start-up"
    assert [name for name, warmup in start if not warmup] == [], "compiled at a real launch during start-up"
    compiled = {name for name, _ in start}
    for kernel in ("_paged_attention_kernel", "_paged_attention_split_kernel", "_split_reduce_kernel",
                   "_rms_norm_kernel", "_qk_norm_rope_kernel", "_silu_and_mul_kernel", "_gumbel_argmax_kernel"):
        assert any(name.endswith(kernel) for name in compiled), (kernel, compiled)
    # Serving compiles nothing at a real launch; the persistent decode kernel, its graph's
    # greedy argmax and the kernels of its filtered (sampling) graphs compile on their background
    # thread (fastpath/seam.py's dry pass: warmups, whether they land before or after LLM() returns),
    # and so do the fused sampler's kernels that read grammar masks (Sampler.masked_dry_pass).
    assert [name for name, warmup in log["serving"] if not warmup] == [], "serving compiled at a real launch"
    background_kernels = ("_decode_kernel", "_greedy_row_kernel", "_penalize_kernel", "_count_kernel",
                          "_tile_stats_kernel", "_threshold_kernel", "_candidates_kernel", "_pick_kernel",
                          "_refine_kernel", "_gumbel_argmax_kernel", "_masked_greedy_kernel")
    background = [name for name, _ in start + log["serving"] if name.endswith(background_kernels)]
    assert {name.rsplit(".", 1)[-1] for name in background} >= {"_decode_kernel", "_greedy_row_kernel"}, background
    assert {name for name, _ in log["serving"]} <= set(background), log["serving"]
