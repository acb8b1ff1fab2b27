"""Checks on text from users before it reaches a tokenizer.

A str can hold lone UTF-16 surrogates (JSON's "\\ud800" escape decodes to one); they are not
encodable as UTF-8, and the fast tokenizers raise a bare TypeError on them. Refusing them here
turns that into a ValueError naming the input.
"""
from __future__ import annotations

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
