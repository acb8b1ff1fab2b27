"""vLLM's `bad_words` as token sequences: the text of each word becomes the token sequences
whose last token the sampler bans where the output ends with the rest (Sequence.bad_word_bans).

The server's front end tokenizes them on its tokenizer thread and hands the sequences to the
engine core with the request (SamplingParams.bad_words_token_ids), so that a request with many
long words does not hold up the core's loop; offline, the engine tokenizes them itself.
"""
from __future__ import annotations

from typing import Any


def bad_words_token_ids(tokenizer: Any, bad_words: list[str], vocab_size: int) -> list[list[int]]:
    """The token sequences that `bad_words` ban, as vLLM's: each word, its leading spaces
    stripped, tokenized without special tokens, and after one space too where that starts
    with another token and has as many (a word inside the text, not at its start). A
    ValueError naming bad_words where there is no tokenizer or a token is outside the
    vocabulary."""
    if tokenizer is None:
        raise ValueError("bad_words: this model has no tokenizer to tokenize them with")
    sequences = []
    for word in bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad_words: {word!r} has no tokens")
        sequences.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    check_in_vocabulary(sequences, vocab_size)
    return sequences


def check_in_vocabulary(sequences: list[list[int]], vocab_size: int) -> None:
    """ValueError naming bad_words where a token of these sequences is outside the vocabulary."""
    outside = sorted({t for ids in sequences for t in ids if not 0 <= t < vocab_size})
    if outside:
        raise ValueError(f"bad_words: their tokens {outside} are outside the vocabulary [0, {vocab_size})")
