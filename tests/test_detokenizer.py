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


def test_a_stop_string_is_found_however_much_text_one_token_adds(tokenizer_dir):
    """A token can add dozens of characters (an indented line's whitespace, a run of dashes):
    a stop string anywhere in them, or spanning the old text and them, is found, the first."""
    from nanovllm.engine.detokenizer import truncate_at_stop

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    detok = IncrementalDetokenizer(tok, [])
    detok.text = "def f():"
    assert not truncate_at_stop(detok, ["\n", "---"])
    detok.text += " " * 40 + "pass" + "\n" + " " * 40  # one token's worth of new text
    assert truncate_at_stop(detok, ["\n", "---"])
    assert detok.text == "def f():" + " " * 40 + "pass"

    detok = IncrementalDetokenizer(tok, [])
    detok.text = "a -"
    assert not truncate_at_stop(detok, ["---"])
    detok.text += "-" * 32  # the stop string spans the old text and the new
    assert truncate_at_stop(detok, ["---"]) and detok.text == "a "


def test_a_stop_string_in_the_min_tokens_text_does_not_count_whatever_the_other_stop_strings(tokenizer_dir):
    """Text from a sample's first min_tokens tokens is never searched for stop strings (vLLM's
    rule): a short stop string that lies wholly in it stays uncounted where a longer stop string
    is given beside it, as where it is given alone; one that reaches into later text counts."""
    from nanovllm.engine.detokenizer import truncate_at_stop

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    pieces, min_tokens = [" Paris", ".", "\n", "\n", "The", " answer", "."], 2
    for stops in (["."], [".", "XYZW"], ["XYZW", "."]):
        detok = IncrementalDetokenizer(tok, [])
        found = None
        for n, piece in enumerate(pieces, 1):
            detok.text += piece
            found = truncate_at_stop(detok, stops, n > min_tokens)
            if found:
                break
        assert (found, detok.text) == (".", " Paris.\n\nThe answer"), stops
    detok = IncrementalDetokenizer(tok, [])
    detok.text = "ab"
    assert not truncate_at_stop(detok, ["bc", "XYZW"], searchable=False)
    detok.text += "c"  # "bc" spans the unsearched text and the new
    assert truncate_at_stop(detok, ["bc", "XYZW"]) == "bc" and detok.text == "a"


def _byte_token_ids(tok, data: bytes) -> list[int]:
    """One byte-level token per byte (GPT-2's byte-to-character alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [tok.convert_tokens_to_ids(chars[b]) for b in data]


def test_streamed_text_equals_the_decode_when_invalid_bytes_precede_a_split_character(tokenizer_dir):
    """Invalid bytes, then a character whose bytes arrive one token at a time: what is streamed
    at every step is a start of the final decode (nothing emitted is ever contradicted), and it
    adds up to it; also for random byte streams, as a random model writes them."""
    import random

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(0)
    cases = [b"\xff\xde\xa9", b"\xff\xfe\xf0\x9f\x99\x82 ok", "a\xffb".encode("latin-1") + "🙂".encode()]
    cases += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))) for _ in range(300)]
    for data in cases:
        ids = _byte_token_ids(tok, data)
        expected = tok.decode(ids)
        detok = IncrementalDetokenizer(tok, tok.encode("hi"))
        for t in ids:
            detok.add(t)
            assert expected.startswith(detok.text), (data, detok.text, expected)
        detok.flush()
        assert detok.text == expected, data


def test_output_text_reads_alike_decoded_at_once_or_token_by_token(checkpoint_factory):
    """A prompt that ends inside a character, and an output that goes on with its bytes: the
    text generate gives is the same whether it is decoded at once (no stop strings), token by
    token (a stop string that never matches) or streamed."""
    from nanovllm import LLM, SamplingParams

    llm = LLM(checkpoint_factory("qwen3"), device="cpu", max_model_len=128, num_kvcache_blocks=32)
    tok = llm.tokenizer
    prompt = tok.encode("hi ") + _byte_token_ids(tok, "🙂".encode()[:2])  # the emoji's first two bytes
    continuation = _byte_token_ids(tok, b"\x99")[0]  # a UTF-8 continuation byte, forced every step
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={continuation: 100.0})
    stopped = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={continuation: 100.0},
                             stop=["\x00never"])
    at_once = llm.generate([prompt], plain, use_tqdm=False)[0].outputs[0]
    by_token = llm.generate([prompt], stopped, use_tqdm=False)[0].outputs[0]
    streamed = [p.outputs[0].text for p in llm.stream(prompt, plain)][-1]
    assert at_once.token_ids == by_token.token_ids == [continuation] * 6
    # the first two continuation bytes complete the prompt's character, so their text is the prompt's
    assert at_once.text == by_token.text == streamed == "\ufffd" * 4
    llm.shutdown()
