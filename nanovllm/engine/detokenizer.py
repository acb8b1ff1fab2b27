"""Incremental detokenization that never emits half a character.

Decoding token by token breaks multi-byte characters (one emoji can span several byte-level
tokens) and loses the leading space that SentencePiece-style tokenizers attach to a word. So we
decode a short window: the text of tokens [prefix_offset:] minus the text of
[prefix_offset:read_offset]. When that new text ends in U+FFFD, its last character may be an
incomplete UTF-8 sequence that later tokens complete: what precedes it is emitted (invalid bytes
before it, e.g. from a random model, are U+FFFD for good) and it is held, with the window, until
the text ends in a complete character. A window held for MAX_HELD_TOKENS tokens (a run of
invalid bytes) is emitted as it is, so that decoding stays short. When the request ends,
`flush` emits whatever is still held, so streamed text adds up to the whole. The window starts
with a few prompt tokens for context.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable

CONTEXT_TOKENS = 4
# A character spans at most 4 byte tokens: a window still ending in U+FFFD after this many
# tokens ends in invalid bytes, and is emitted as it is.
MAX_HELD_TOKENS = 64


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


def text_after(decode: Callable[[list[int]], str], tokens: list[int], start: int, split: int) -> str:
    """The text tokens[split:] add to tokens[start:split] (and what they change of it), both
    decoded from `start`: a token's text depends on what precedes it."""
    prefix_text = decode(tokens[start:split])
    full_text = decode(tokens[start:])
    return full_text[len(prefix_text):] if len(full_text) > len(prefix_text) else ""


def decode_after(tokenizer, prompt_token_ids: list[int], ids: list[int], skip_special_tokens: bool = True) -> str:
    """The text of output `ids` decoded at once, as an IncrementalDetokenizer reads it token by
    token: after the prompt's last CONTEXT_TOKENS tokens, so that a token's text depends on
    what precedes it alike (the leading space a tokenizer drops at the start of a text, the
    rest of a character whose first bytes end the prompt)."""
    context = list(prompt_token_ids[-CONTEXT_TOKENS:])
    return text_after(ids_decoder(tokenizer, skip_special_tokens), context + list(ids), 0, len(context))


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
        self._emitted = 0  # characters of the held window's new text already emitted

    def _new_text(self) -> str:
        """The window's text past its prefix (tokens [read_offset:] and what they change)."""
        return text_after(self._decode, self.tokens, self.prefix_offset, self.read_offset)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the newly completed text (maybe empty)."""
        self.tokens.append(token_id)
        new = self._new_text()
        if not new:
            return ""
        if new.endswith("\ufffd") and len(self.tokens) - self.read_offset < MAX_HELD_TOKENS:
            complete = len(new) - 1  # the last character may still change: hold it
            delta = new[self._emitted : complete] if complete > self._emitted else ""
            self._emitted = max(self._emitted, complete)
        else:
            delta = new[self._emitted :]
            self.prefix_offset, self.read_offset, self._emitted = self.read_offset, len(self.tokens), 0
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit text still held back for an incomplete character (the request has ended)."""
        delta = self._new_text()[self._emitted :]
        self.prefix_offset = self.read_offset = len(self.tokens)
        self._emitted = 0
        self.text += delta
        return delta


def streamable_text(detok: IncrementalDetokenizer, stops: list[str], whole: bool, include_stop: bool = False) -> str:
    """detok's text as a stream may show it: unless `whole` (the sample has finished), less the
    characters at its end that may still become the start of a stop string (none where the stop
    string stays in the output, include_stop: what precedes it stays too, as vLLM streams it)."""
    text = detok.text
    if whole or not stops or include_stop:
        return text
    return text[: max(0, len(text) - (max(len(s) for s in stops) - 1))]


def truncate_at_stop(detok: IncrementalDetokenizer, stops: list[str], searchable: bool = True,
                     include_stop: bool = False) -> str | None:
    """Cut `detok.text` before the first stop string in the text not searched yet (and the
    characters before it that a stop string could still span), or right after it with
    include_stop (vLLM's include_stop_str_in_output); the stop string found, or None. The text
    searched before had no stop string, so only a match reaching into the new text is new,
    however much text the last token added. searchable=False (the sample has not yet more than
    its min_tokens tokens: vLLM's rule) marks the new text searched without searching it."""
    text = detok.text
    if not searchable:
        detok.stop_checked = len(text)
        return None
    best, found = -1, None
    for s in stops:  # a match must reach into the text not searched yet
        i = text.find(s, max(0, detok.stop_checked - len(s) + 1))
        if i != -1 and (best == -1 or i < best):
            best, found = i, s
    if found is None:
        detok.stop_checked = len(text)
        return None
    end = best + len(found) if include_stop else best
    detok.text = text[:end]
    detok.stop_checked = end
    return found


def ended_by_stop_token(reason: str | None, token: int, stop_token_ids: list[int], eos_token_ids: list[int]) -> bool:
    """Whether a sample that ended with `reason` on `token` was ended by that token as a stop
    token (an EOS id, or one of the request's stop_token_ids). Its text is left out of the
    output, as vLLM leaves it out, unless include_stop_str_in_output; the token stays in
    token_ids."""
    return reason == "stop" and (token in stop_token_ids or token in eos_token_ids)


def text_token_ids(token_ids: list[int], reason: str | None, stop_token_ids: list[int],
                   eos_token_ids: list[int], include_stop: bool = False) -> list[int]:
    """The output's ids whose text it shows: all but a stop token that ended it (all of them
    with include_stop: vLLM's include_stop_str_in_output)."""
    if (not include_stop and token_ids
            and ended_by_stop_token(reason, token_ids[-1], stop_token_ids, eos_token_ids)):
        return token_ids[:-1]
    return token_ids


def stop_token_reason(token: int, ignore_eos: bool, stop_token_ids: list[int], eos_token_ids: list[int]) -> int | None:
    """vLLM's stop_reason for a sample that `token` ends as a stop token: the stop_token_ids
    entry; None for EOS, which is checked first (unless ignore_eos)."""
    if token in stop_token_ids and (ignore_eos or token not in eos_token_ids):
        return token
    return None
