"""Incremental detokenization that never emits half a character.

Decoding token by token breaks multi-byte characters (one emoji can span several byte-level
tokens) and loses the leading space that SentencePiece-style tokenizers attach to a word. So we
decode a short window: the text of tokens [prefix_offset:] minus the text of
[prefix_offset:read_offset]; when the new text ends in U+FFFD (an incomplete UTF-8 sequence) we
wait for more tokens. An incomplete character at the end decodes to exactly one U+FFFD; two or
more in a row are invalid bytes (e.g. from a random model) that no later token can mend, so they
are emitted as they are rather than held back forever. When the
request ends, `flush` emits whatever is still held, so streamed text always adds up to the whole.
The window starts with a few prompt tokens for context.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable

CONTEXT_TOKENS = 4


def ids_decoder(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=...)` as a function of the ids. A transformers
    fast tokenizer whose decode adds nothing to its `tokenizers` backend's (neither a decode of
    its own nor spaces clean-up) is decoded by the backend directly: transformers' handling of
    the ids around it costs twice the decode itself, and a stream decodes twice a token."""
    module = sys.modules.get("transformers.tokenization_utils_tokenizers")
    base = sys.modules.get("transformers.tokenization_utils_base")
    if (module is not None and base is not None and isinstance(tokenizer, module.TokenizersBackend)
            and type(tokenizer).decode is base.PreTrainedTokenizerBase.decode
            and type(tokenizer)._decode is module.TokenizersBackend._decode
            and not tokenizer.clean_up_tokenization_spaces):
        return functools.partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode = ids_decoder(tokenizer, skip_special_tokens)
        self.tokens: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        self.stop_checked = 0  # text[:stop_checked] holds no stop string (truncate_at_stop)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the newly completed text (maybe empty)."""
        self.tokens.append(token_id)
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset :])
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith("\ufffd") and not full_text.endswith("\ufffd\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit text still held back for an incomplete character (the request has ended)."""
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset :])
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.tokens)
        self.text += delta
        return delta


def truncate_at_stop(detok: IncrementalDetokenizer, stops: list[str]) -> bool:
    """Cut `detok.text` before the first stop string in the text not searched yet (and the
    characters before it that a stop string could still span); True if one was found. The text
    searched before had no stop string, so only a match reaching into the new text is new,
    however much text the last token added."""
    text = detok.text
    start = max(0, detok.stop_checked - (max(len(s) for s in stops) - 1))
    best = -1
    for s in stops:
        i = text.find(s, start)
        if i != -1 and (best == -1 or i < best):
            best = i
    if best == -1:
        detok.stop_checked = len(text)
        return False
    detok.text = text[:best]
    detok.stop_checked = best
    return True
