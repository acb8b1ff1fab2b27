"""Each token's raw bytes, for chat logprobs' `bytes`.

OpenAI's `bytes` let a client rebuild text whose characters span several tokens by joining the
tokens' bytes. A token's decoded text cannot give them: a token holding part of a multi-byte
character (CJK, emoji with byte-level BPE) decodes to U+FFFD. So they are read from the token's
string (`id_to_token`) as the tokenizer's decoder reads it, added and special tokens too (the
`tokenizers` library decodes them alike; "<|im_end|>" reads as its text):

- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2: a ByteLevel decoder or pre-tokenizer): each
  character stands for one byte (GPT-2's bytes_to_unicode table, inverted);
- SentencePiece-style (Llama 2, Mistral, Gemma: a Metaspace or ByteFallback decoder): `<0xNN>` is
  the byte NN (with ByteFallback), any other piece its UTF-8 with "▁" a space; a leading "▁" is a
  space too (the decoder drops it only at the start of a whole text, and output text follows the
  prompt);
- everything else (another decoder, a tokenizer with no `tokenizers` backend, an id outside the
  vocabulary, a string with a character no byte stands for, which the ByteLevel decoder keeps
  as it is): the UTF-8 of the token's decoded text.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE_PIECE = "\u2581"  # "▁", SentencePiece's space

PieceReader = Callable[[str], bytes | None]


def byte_level_table() -> dict[str, int]:
    """GPT-2's bytes_to_unicode inverted: the character that stands for each byte -> that byte.
    Printable Latin-1 bytes stand for themselves; the others, in order, for chr(256), chr(257), …"""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def _types(node: Any) -> set[str]:
    """The component types in a decoder's or pre-tokenizer's JSON, those inside a Sequence too."""
    if isinstance(node, list):
        return set().union(*map(_types, node))
    if not isinstance(node, dict):
        return set()
    found = {node["type"]} if isinstance(node.get("type"), str) else set()
    return found.union(*map(_types, node.values()))


def _component_types(component: Any) -> set[str]:
    # A tokenizers component pickles as its JSON (what tokenizer.json holds for it).
    return set() if component is None else _types(json.loads(component.__getstate__()))


def piece_reader(backend: Any) -> PieceReader | None:
    """How a `tokenizers.Tokenizer`'s token strings read as bytes (None where they are not
    bytes of a known form): byte-level or SentencePiece-style, told by its decoder and
    pre-tokenizer."""
    decoder, pre_tokenizer = _component_types(backend.decoder), _component_types(backend.pre_tokenizer)
    if "ByteLevel" in decoder | pre_tokenizer:
        table = byte_level_table()

        def byte_level(piece: str) -> bytes | None:
            try:
                return bytes([table[c] for c in piece])
            except KeyError:  # a character no byte stands for
                return None

        return byte_level
    if decoder & {"Metaspace", "ByteFallback"}:
        byte_fallback = "ByteFallback" in decoder

        def sentencepiece(piece: str) -> bytes | None:
            match = _BYTE_PIECE.fullmatch(piece) if byte_fallback else None
            return bytes([int(match[1], 16)]) if match else piece.replace(_SPACE_PIECE, " ").encode()

        return sentencepiece
    return None


class TokenBytes:
    """Token id -> its raw bytes as `bytes` fields give them (a list of ints), cached per id.
    `text` gives a token's decoded text (the fallback)."""

    def __init__(self, tokenizer: Any, text: Callable[[int], str]) -> None:
        self.text = text
        self.cache: dict[int, list[int]] = {}
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.read = piece_reader(self.backend) if self.backend is not None else None

    def __call__(self, token_id: int) -> list[int]:
        found = self.cache.get(token_id)
        if found is None:
            found = self.cache[token_id] = list(self._bytes(token_id))
        return found

    def _bytes(self, token_id: int) -> bytes:
        if self.read is not None:
            piece = self.backend.id_to_token(token_id)
            raw = self.read(piece) if piece is not None else None
            if raw is not None:
                return raw
        return self.text(token_id).encode("utf-8")
