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


def test_flush_emits_a_trailing_incomplete_character(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok.encode("ok 🙂")
    detok = IncrementalDetokenizer(tok, [])
    streamed = "".join(detok.add(t) for t in ids[:-1])  # stop one byte-token short of the emoji
    streamed += detok.flush()
    assert streamed == tok.decode(ids[:-1]) and streamed.endswith("\ufffd")


def test_invalid_bytes_do_not_hold_back_text_forever(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    lone = tok.encode("🙂")[0]  # the emoji's first byte alone: never completes into a character
    ids = tok.encode("a") + [lone] * 6 + tok.encode(" fine words")
    detok = IncrementalDetokenizer(tok, [])
    streamed = "".join(detok.add(t) for t in ids) + detok.flush()
    assert streamed == tok.decode(ids)
    assert "fine words" in detok.text


def test_ids_decoder_equals_the_tokenizers_decode(tokenizer_dir):
    """The detokenizer's decode (a fast tokenizer's backend, called directly) gives exactly the
    tokenizer's own decode, special tokens skipped or kept, on random ids and on real text."""
    import random

    from nanovllm.engine.detokenizer import ids_decoder

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    fast = ids_decoder(tok, True)
    assert fast.func == tok.backend_tokenizer.decode  # this tokenizer takes the direct path
    rng = random.Random(0)
    specials = tok.all_special_ids
    cases = [tok.encode("héllo 🙂 wörld, 日本語")] + [
        [rng.choice(specials) if rng.random() < 0.2 else rng.randrange(len(tok)) for _ in range(rng.randrange(1, 12))]
        for _ in range(200)
    ]
    for skip in (True, False):
        decode = ids_decoder(tok, skip)
        for ids in cases:
            assert decode(ids) == tok.decode(ids, skip_special_tokens=skip)
