"""A model's sampling defaults (generation_config.json, GGUF general.sampling.*): what
LLM.get_default_sampling_params(), generate() without params and the CLI take from them."""
from __future__ import annotations

import json
import logging
import shutil

import gguf
import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.entrypoints.cli import build_parser, _sampling_params
from nanovllm.loaders.generation_config import read_hf_defaults


@pytest.fixture
def model_dir(qwen3_tiny, tmp_path):
    """A copy of the tiny checkpoint whose generation_config.json the test writes."""
    path = tmp_path / "model"
    shutil.copytree(qwen3_tiny, path)
    return path


def write_config(path, **values):
    config_file = path / "generation_config.json"
    base = json.loads(config_file.read_text()) if config_file.exists() else {}
    config_file.write_text(json.dumps({**base, **values}))


QWEN3 = dict(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, repetition_penalty=1.05, max_new_tokens=33,
             do_sample=True, presence_penalty=1.0)  # presence_penalty: not a field vLLM takes from it


def test_defaults_come_from_generation_config(model_dir):
    write_config(model_dir, **QWEN3)
    llm = LLM(str(model_dir), device="cpu", max_model_len=256)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (0.6, 0.95, 20, 0.0, 1.05, 33)
    assert p.presence_penalty == 0.0
    # generate() without params uses them: max_new_tokens caps the output.
    out = llm.generate([[1, 2, 3]], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 33 or out.finish_reason == "stop"
    none = LLM(str(model_dir), device="cpu", max_model_len=256, generation_config="none")
    assert none.get_default_sampling_params() == SamplingParams()


def test_no_generation_config_means_sampling_params_defaults(qwen3_tiny):
    assert LLM(str(qwen3_tiny), device="cpu", max_model_len=256).get_default_sampling_params() == SamplingParams()


def test_nonsense_values_are_ignored_with_a_warning_naming_them(model_dir, caplog):
    write_config(model_dir, temperature=-1, top_k="many", top_p=0.9, repetition_penalty=0, max_new_tokens=2.5, min_p=0.1)
    with caplog.at_level(logging.WARNING, logger="nanovllm"):
        defaults = read_hf_defaults(str(model_dir))
    assert defaults == dict(top_p=0.9, min_p=0.1)
    for key in ("temperature", "top_k", "repetition_penalty", "max_new_tokens"):
        assert f"ignoring {key}=" in caplog.text
    write_config(model_dir, top_k=0, max_new_tokens=12.0)  # 0 = off, as in transformers; integral floats are ints
    assert read_hf_defaults(str(model_dir))["top_k"] == -1 and read_hf_defaults(str(model_dir))["max_tokens"] == 12
    (model_dir / "generation_config.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="nanovllm"):
        assert read_hf_defaults(str(model_dir)) == {}
    assert "not readable JSON" in caplog.text
    assert LLM(str(model_dir), device="cpu", max_model_len=256).get_default_sampling_params() == SamplingParams()


def test_bad_generation_config_option_names_it():
    with pytest.raises(ValueError, match="generation_config"):
        LLM(None, generation_config="vllm")


def test_gguf_sampling_metadata_counts_the_same(qwen3_tiny, tmp_path):
    from test_gguf import write_gguf

    def sampling(writer: gguf.GGUFWriter) -> None:
        writer.add_float32("general.sampling.temp", 0.7)
        writer.add_float32("general.sampling.top_p", 0.8)
        writer.add_int32("general.sampling.top_k", 40)
        writer.add_float32("general.sampling.min_p", 0.05)
        writer.add_float32("general.sampling.penalty_repeat", 1.1)
        writer.add_int32("general.sampling.penalty_last_n", 64)  # llama.cpp's window: not vLLM's definition

    path = tmp_path / "m.gguf"
    write_gguf(path, qwen3_tiny, gguf.GGMLQuantizationType.F32, extra_kv=sampling)
    p = LLM(str(path), device="cpu", max_model_len=256).get_default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.7, 0.8, 40, 0.05, 1.1)


def test_cli_flags_over_model_defaults_over_cli_defaults():
    def params(*argv: str, defaults: dict) -> SamplingParams:
        args = build_parser().parse_args(["generate", *argv, "hi"])
        return _sampling_params(args, defaults)

    model = dict(temperature=0.6, top_k=20, max_tokens=33)
    p = params(defaults=model)
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens, p.repetition_penalty) == (0.6, 20, 1.0, 33, 1.0)
    p = params("--temperature", "0", "--max-tokens", "5", "--presence-penalty", "1.5", "--frequency-penalty", "-1",
               "--repetition-penalty", "1.2", defaults=model)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.0, 20, 5)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1.5, -1.0, 1.2)
    p = params(defaults={})
    assert (p.temperature, p.max_tokens) == (0.0, 64)  # the CLI's own: greedy
    with pytest.raises(ValueError, match="presence_penalty"):
        params("--presence-penalty", "3", defaults={})


@pytest.mark.parametrize("env, expected", [(None, False), ("1", None), ("0", None)])
def test_cli_generate_leaves_cpu_compile_to_the_environment_where_it_is_set(monkeypatch, env, expected):
    """`nanovllm generate` does not wait for the compiled decode's build unless asked: by
    --cpu-compile, or by NANOVLLM_CPU_COMPILE, which the engine then reads (README)."""
    import nanovllm
    from nanovllm.entrypoints.cli import cmd_generate

    seen = {}

    class Stop(Exception):
        pass

    def fake_llm(model, **kwargs):
        seen.update(kwargs)
        raise Stop

    if env is None:
        monkeypatch.delenv("NANOVLLM_CPU_COMPILE", raising=False)
    else:
        monkeypatch.setenv("NANOVLLM_CPU_COMPILE", env)
    monkeypatch.setattr(nanovllm, "LLM", fake_llm)
    with pytest.raises(Stop):
        cmd_generate(build_parser().parse_args(["generate", "hi"]))
    assert seen["cpu_compile"] is expected
