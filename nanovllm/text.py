"""Checks on prompts from users before they reach a tokenizer or the engine.

A str can hold lone UTF-16 surrogates (JSON's "\\ud800" escape decodes to one); they are not
encodable as UTF-8, and the fast tokenizers raise a bare TypeError on them. Refusing them here
turns that into a ValueError naming the input. A prompt of token ids must hold integers in the
vocabulary.
"""
from __future__ import annotations

import numbers
import re

_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, what: str) -> str:
    """`text` unchanged; ValueError naming `what` if it holds a lone surrogate."""
    match = _SURROGATE.search(text)
    if match is not None:
        raise ValueError(
            f"{what} contains a lone surrogate (U+{ord(match.group()):04X}) at index {match.start()}: "
            "text must be valid Unicode"
        )
    return text


def check_token_ids(prompt, vocab_size: int) -> list[int]:
    """A prompt of token ids as a list of ints (numpy's integers are ids too); ValueError naming
    the first id that is not an integer or lies outside [0, vocab_size)."""
    ids = []
    for t in prompt:
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise ValueError(f"token id {t!r} is not an integer")
        if not 0 <= t < vocab_size:
            raise ValueError(f"token id {t!r} is outside the vocabulary [0, {vocab_size})")
        ids.append(int(t))
    return ids
