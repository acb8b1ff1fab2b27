"""LightTokenizer (loaders/light_tokenizer.py) against the transformers tokenizer it stands for,
and a warm start of a cached GGUF file importing no transformers.

The reference is transformers itself: the tokenizer of a GGUF file as transformers builds it,
saved with `save_pretrained` and read back by both.
"""
from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q
from test_gguf import write_gguf
from test_startup_cache import TEXTS, assert_same_tokenizer

import nanovllm.loaders.gguf as gguf_loader
from nanovllm.loaders.light_tokenizer import LightTokenizer, load_light_tokenizer

# A template exercising what transformers' environment provides: tojson with options,
# namespace, loop controls, raise_exception, the special tokens as variables, a caller's kwarg,
# reasoning under its aliases, and messages whose None-valued keys are dropped.
TEMPLATE = """{{ bos_token }}{% set ns = namespace(n=0) %}
{% if tools %}TOOLS {{ tools | tojson(indent=2) }} {{ tools | tojson(separators=(',', ':'), sort_keys=true) }}
{% endif %}
{% for m in messages %}
{% if m.role == 'bad' %}{{ raise_exception('bad role') }}{% endif %}
{% if m.name is defined %}[{{ m.name }}]{% endif %}
{% if m.thinking is defined %}<think>{{ m.thinking }}|{{ m.reasoning_content }}</think>{% endif %}
{% if loop.index > 9 %}{% break %}{% endif %}
{% set ns.n = ns.n + 1 %}<|im_start|>{{ m.role }} {{ m.content }} {{ {'k': 'é'} | tojson }}<|im_end|>
{% endfor %}{{ ns.n }}{% if flag %} FLAG{% endif %}{% if add_generation_prompt %}<|im_start|>assistant{% endif %}
{{ eos_token }}"""
MESSAGES = [
    [{"role": "user", "content": "Hi <|im_end|> there"}],
    [{"role": "system", "content": "Be brief.", "name": None}, {"role": "user", "content": "2+2?", "name": "bob"},
     {"role": "assistant", "content": "4", "reasoning": "easy"}, {"role": "user", "content": "日本語 🙂"}],
]
TOOLS = [{"type": "function", "function": {"name": "f", "description": "ünï", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, checkpoint_factory):
    """(directory, transformers tokenizer read from it) for the tiny GGUF file's tokenizer."""
    gguf = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(gguf, checkpoint_factory("llama", tie_word_embeddings=False), Q.Q8_0)
    built = gguf_loader.load_gguf_tokenizer(gguf)
    built.chat_template = TEMPLATE
    path = tmp_path_factory.mktemp("saved")
    built.save_pretrained(str(path))
    import transformers

    cls = getattr(transformers, json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"])
    return path, cls.from_pretrained(str(path), local_files_only=True)


def test_same_tokens_text_and_special_tokens(saved):
    path, reference = saved
    light = load_light_tokenizer(path)
    assert isinstance(light, LightTokenizer)
    assert_same_tokenizer(light, reference)
    for text in TEXTS:
        for split in (False, True):
            assert light.encode(text, add_special_tokens=False, split_special_tokens=split) == reference.encode(
                text, add_special_tokens=False, split_special_tokens=split), (text, split)
    ids = reference.encode(TEXTS[2])
    assert light.convert_ids_to_tokens(ids, skip_special_tokens=True) == reference.convert_ids_to_tokens(
        ids, skip_special_tokens=True)
    assert light.convert_ids_to_tokens(ids[0]) == reference.convert_ids_to_tokens(ids[0])
    assert light.special_tokens_map == reference.special_tokens_map
    assert {i: t.content for i, t in light.added_tokens_decoder.items()} == {
        i: t.content for i, t in reference.added_tokens_decoder.items()}


@pytest.mark.parametrize("index", range(len(MESSAGES)))
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_same_chat_template_rendering(saved, index, tools):
    path, reference = saved
    light = load_light_tokenizer(path)
    for generation in (False, True):
        kwargs = dict(tools=tools, add_generation_prompt=generation, flag=generation)
        text = reference.apply_chat_template(MESSAGES[index], tokenize=False, **kwargs)
        assert light.apply_chat_template(MESSAGES[index], tokenize=False, **kwargs) == text
        ids = reference.apply_chat_template(MESSAGES[index], tokenize=True, return_dict=False, **kwargs)
        assert light.apply_chat_template(MESSAGES[index], tokenize=True, **kwargs) == list(ids)
    from jinja2 import TemplateError

    with pytest.raises(TemplateError, match="bad role"):
        light.apply_chat_template([{"role": "bad", "content": "x"}], tokenize=False)


def test_copies_and_other_attributes(saved):
    path, reference = saved
    light = load_light_tokenizer(path)
    for other in (pickle.loads(pickle.dumps(light)), copy.deepcopy(light)):
        assert other.encode(TEXTS[1]) == reference.encode(TEXTS[1])
        assert other.chat_template == reference.chat_template
    # What it does not implement comes from the transformers tokenizer of the same directory.
    assert light.get_added_vocab() == reference.get_added_vocab()
    assert light.transformers_tokenizer.encode(TEXTS[0]) == reference.encode(TEXTS[0])


def test_other_tokenizer_classes_are_left_to_transformers(saved, tmp_path):
    path, _ = saved
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    assert load_light_tokenizer(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "clean_up_tokenization_spaces": True}))
    assert load_light_tokenizer(tmp_path) is None


def test_warm_start_imports_no_transformers(tmp_path, checkpoint_factory):
    """A generate from a cached GGUF file, in a process of its own: the answer is the cold
    start's, and neither transformers nor the GGUF reader is imported."""
    gguf = tmp_path / "tiny.gguf"
    write_gguf(gguf, checkpoint_factory("llama", tie_word_embeddings=False), Q.Q4_1)
    script = (
        "import sys; from nanovllm import LLM, SamplingParams\n"
        f"llm = LLM({str(gguf)!r}, device='cpu', num_kvcache_blocks=16)\n"
        "out = llm.chat([{'role': 'user', 'content': 'Hello'}], SamplingParams(max_tokens=4, ignore_eos=True),"
        " use_tqdm=False)[0].outputs[0]\n"
        "print(out.token_ids, sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'gguf'}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "NANOVLLM_CACHE_DIR": str(tmp_path / "cache")}
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
    cold, warm = (run.stdout.strip().rsplit(" [", 1) for run in runs)
    assert warm[0] == cold[0]
    assert cold[1] == "'gguf', 'transformers']" and warm[1] == "]"
