"""Chat messages -> prompt token ids, with message contents kept as plain text.

A chat template renders the messages into one string. Tokenizing that string with special
tokens parsed (what `apply_chat_template` + `encode` do, and what vLLM and llama.cpp do) turns
special-token text inside a message, e.g. a user writing `<|im_end|>\\n<|im_start|>system`, into
the real control tokens: the user can forge a system turn. So contents are tokenized apart:
the template is rendered with a unique placeholder in place of each content; the template's
own text between placeholders is tokenized with special tokens parsed (its role markers), each
content with `split_special_tokens=True` (special-token text stays ordinary text), and the ids
are concatenated in order. `parse_special_tokens=True` gives the plain behaviour (the rendered
string tokenized whole).

The template sees placeholders, not contents: a template that inspects or transforms content
(strips it, splits it on `</think>`) acts on the placeholder, and the content goes in as sent.

`check_messages` gives the errors for malformed messages (no role, an unknown role, a content
that is not text) as ValueError/TypeError naming the message, instead of the template's
jinja2 errors.
"""
from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from typing import Any

from nanovllm.text import check_text

ROLES = ("system", "user", "assistant")


def check_messages(messages: Any) -> list[dict[str, str]]:
    """Messages as [{"role", "content"}] with string contents (None -> ""), checked: a list of
    dicts, each with a role in ROLES and a str content. TypeError for a wrong type, ValueError
    for a wrong value, naming the message."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if role is None:
            raise ValueError(f"messages[{i}] has no 'role'")
        if not isinstance(role, str) or role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}")
        content = message.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise TypeError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        checked.append({"role": role, "content": check_text(content, f"messages[{i}].content")})
    return checked


def render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The template applied to checked messages (a string); ValueError if the model has none or
    the template rejects them."""
    from jinja2 import TemplateError

    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except (TemplateError, KeyError, TypeError) as exc:
        raise ValueError(f"the chat template rejected the messages: {exc}") from None


def chat_prompt_ids(
    tokenizer: Any, messages: Any, add_generation_prompt: bool = True, parse_special_tokens: bool = False
) -> list[int]:
    """Prompt token ids for `messages` (see the module docstring). The template holds any BOS,
    so nothing is added around it."""
    messages = check_messages(messages)
    if parse_special_tokens:
        return tokenizer.encode(render(tokenizer, messages, add_generation_prompt), add_special_tokens=False)
    nonce = secrets.token_hex(8)
    holders = [f"NANOVLLMCONTENT{nonce}N{i}X" for i in range(len(messages))]
    text = render(tokenizer, [{**m, "content": h} for m, h in zip(messages, holders)], add_generation_prompt)
    index = {h: i for i, h in enumerate(holders)}
    ids: list[int] = []
    for j, piece in enumerate(re.split(f"(NANOVLLMCONTENT{nonce}N\\d+X)", text)):
        if not piece:
            continue
        if j % 2:  # a placeholder: the content, special-token text kept as text
            content = messages[index[piece]]["content"]
            if content:
                ids += tokenizer.encode(content, add_special_tokens=False, split_special_tokens=True)
        else:  # the template's own text: its markers are special tokens
            ids += tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=False)
    return ids
