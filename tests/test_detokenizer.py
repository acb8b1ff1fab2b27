"""Incremental detokenization: deltas concatenate to the full decode and never split a character."""
from transformers import AutoTokenizer

from nanovllm.engine.detokenizer import IncrementalDetokenizer


def test_multibyte_characters_stream_whole(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = "héllo wörld, 日本語のテキスト 🙂 naïve café!"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # byte-level pieces: characters span several tokens
    prompt = tok.encode("Say:")
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(t) for t in ids]
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0  # some tokens had to wait for the rest of a character
