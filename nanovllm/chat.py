"""Chat messages (and tool definitions) -> prompt token ids, with client text kept as plain text.

A chat template renders the messages into one string. Tokenizing that string with special
tokens parsed (what `apply_chat_template` + `encode` do, and what vLLM and llama.cpp do) turns
special-token text inside a message, e.g. a user writing `<|im_end|>\\n<|im_start|>system`, into
the real control tokens: the user can forge a system turn. So a content holding special-token
text is tokenized apart: the template is rendered with a unique placeholder in its place; the
text between placeholders (the template's, with the other contents in it) is tokenized with
special tokens parsed (its role markers), each such content with `split_special_tokens=True`
(special-token text stays ordinary text), and the ids are concatenated in order. A chat whose
client text holds no special-token text is therefore tokenized exactly as transformers
tokenizes the rendered chat. `parse_special_tokens=True` gives the plain behaviour (the
rendered string tokenized whole) in every case.

Tool definitions, the arguments of earlier tool calls and `chat_template_kwargs` reach the
template as data, which templates print as JSON (`tojson`) or inspect. Their strings go in
unchanged, except a string holding special-token text: it becomes a placeholder too, whose
text (JSON-escaped for tools and arguments, as `tojson` prints it) is tokenized as plain text.

The template sees a placeholder where a content holds special-token text: a template that
inspects or transforms content (strips it, splits it on `</think>`) acts on the placeholder
there, and that content goes in as sent.

`check_messages` and `check_tools` give the errors for malformed input (no role, an unknown
role, a content that is not text, a tool call without a function name, ...) as
ValueError/TypeError naming the field, instead of the template's jinja2 errors.
"""
from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Sequence
from typing import Any

from nanovllm.sampling_params import metaschema_problem, nests_deeper, schema_text
from nanovllm.text import check_text

ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI's newer name for the system role; chat templates know only "system".
TEMPLATE_ROLE = {"developer": "system"}
# vLLM's rule for function names (and OpenAI's).
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# A tool call's arguments (in an assistant message), and a request's chat_template_kwargs, nest
# objects and arrays at most this deep (the template and the injection guard walk them).
MAX_ARGUMENTS_DEPTH = 128
# apply_chat_template's own arguments: a request's chat_template_kwargs cannot set them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def _check_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls, with each call's arguments (JSON text) decoded to
    the object templates expect."""
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise TypeError(f"{where} must be a list of tool calls, got {type(calls).__name__}")
    checked = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise TypeError(f"{at} must be a dict with 'id', 'type' and 'function', got {type(call).__name__}")
        if call.get("type", "function") != "function":
            raise ValueError(f"{at}.type must be 'function'; got {call.get('type')!r}")
        function = call.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{at}.function must be a dict with 'name' and 'arguments'")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ValueError(f"{at}.function.name must be 1-64 letters, digits, '_' or '-'; got {name!r}")
        arguments = function.get("arguments", "{}")
        too_deep = f"{at}.function.arguments nests objects and arrays more than {MAX_ARGUMENTS_DEPTH} levels deep"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(check_text(arguments, f"{at}.function.arguments"))
            except ValueError:
                raise ValueError(f"{at}.function.arguments must be the JSON text of an object") from None
            except RecursionError:  # nested deeper than Python's parser goes
                raise ValueError(too_deep) from None
        if not isinstance(arguments, dict):
            raise ValueError(f"{at}.function.arguments must be the JSON text of an object")
        if nests_deeper(arguments, MAX_ARGUMENTS_DEPTH):
            raise ValueError(too_deep)
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise TypeError(f"{at}.id must be a string")
        checked.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return checked


def content_text(content: Any, where: str) -> str:
    """A message's content as text: a string, None (""), or OpenAI's list of content parts, of
    which only text parts ({"type": "text", "text": ...}) are taken, joined by newlines as vLLM
    joins them. ValueError naming `where` for any other part, TypeError for another type."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence) or isinstance(content, bytes):
        raise TypeError(f"{where} must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(f"{where}[{j}]: content parts of type {kind!r} are not supported (text only, "
                             "as {'type': 'text', 'text': ...})")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}].text must be a string (a text part is {{'type': 'text', 'text': ...}})")
        texts.append(part["text"])
    return "\n".join(texts)


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages as [{"role", "content", ...}] with string contents (None -> "", a list of text
    parts -> their text: `content_text`), checked: a list of dicts, each with a role in ROLES
    (developer becomes system) and such a content; an
    assistant message may carry `tool_calls`, a tool message carries `tool_call_id`. TypeError
    for a wrong type, ValueError for a wrong value, naming the message."""
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
        content = content_text(message.get("content"), f"messages[{i}].content")
        entry: dict[str, Any] = {"role": TEMPLATE_ROLE.get(role, role),
                                 "content": check_text(content, f"messages[{i}].content")}
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise ValueError(f"messages[{i}].tool_calls: only assistant messages carry tool calls")
            entry["tool_calls"] = _check_tool_calls(message["tool_calls"], f"messages[{i}].tool_calls")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ValueError(f"messages[{i}].tool_call_id: a tool message needs the id of the call it answers")
            entry["tool_call_id"] = call_id
        elif message.get("tool_call_id") is not None:
            raise ValueError(f"messages[{i}].tool_call_id: only tool messages carry a tool_call_id")
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        checked.append(entry)
    return checked


class CheckedTools(list):
    """Tool definitions as `check_tools` returns them; given these again, it returns them as they
    are (a schema's check costs milliseconds, so a request's tools are checked once)."""


def check_tools(tools: Any) -> CheckedTools | None:
    """Tool definitions in OpenAI's shape ({"type": "function", "function": {"name",
    "description", "parameters"}}), checked; `parameters` must be a valid JSON schema, within the
    bounds of structured outputs' (sampling_params.schema_text). None or [] -> None."""
    if tools is None:
        return None
    if isinstance(tools, CheckedTools):
        return tools
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise TypeError(f"tools must be a list of tool definitions, got {type(tools).__name__}")
    checked = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise TypeError(f"{at} must be a dict with 'type' and 'function', got {type(tool).__name__}")
        if tool.get("type") != "function":
            raise ValueError(f"{at}.type must be 'function'; got {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{at}.function must be a dict with 'name', 'description' and 'parameters'")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ValueError(f"{at}.function.name must be 1-64 letters, digits, '_' or '-'; got {name!r}")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise ValueError(f"{at}.function.description must be a string")
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise ValueError(f"{at}.function.parameters must be a JSON schema object")
            problem = metaschema_problem(schema_text(parameters, f"{at}.function.parameters"))
            if problem is not None:
                raise ValueError(f"{at}.function.parameters is not a valid JSON schema: {problem}")
        checked.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    names = [t["function"]["name"] for t in checked]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ValueError(f"tools[{i}].function.name: {name!r} is defined twice")
    return CheckedTools(checked) if checked else None


class ChatTemplateError(ValueError):
    """The chat template failed to render the messages (a template error, or one it raised)."""


class TemplateKwargsError(ValueError):
    """chat_template_kwargs that the template cannot take (`check_template_kwargs`)."""


class ToolsError(ValueError):
    """Tool definitions that `check_tools` refuses, met while building a chat prompt."""


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """chat_template_kwargs (vLLM's request field): extra variables for the template.
    TemplateKwargsError if they are not an object with string keys, set the template's own
    arguments or nest too deeply."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise TemplateKwargsError("chat_template_kwargs must be an object with string keys")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise TemplateKwargsError(f"chat_template_kwargs cannot set {', '.join(reserved)}")
    if nests_deeper(kwargs, MAX_ARGUMENTS_DEPTH):
        raise TemplateKwargsError(f"chat_template_kwargs is nested too deeply (more than {MAX_ARGUMENTS_DEPTH} "
                                  "levels of objects and arrays)")
    return dict(kwargs)


def error_field(exc: Exception, request_template: bool = False) -> str:
    """The request field a `chat_prompt_ids` error is about: chat_template_kwargs, tools,
    chat_template (where the request gave the template that failed) or messages."""
    if isinstance(exc, TemplateKwargsError):
        return "chat_template_kwargs"
    if isinstance(exc, ToolsError):
        return "tools"
    if isinstance(exc, ChatTemplateError) and request_template:
        return "chat_template"
    return "messages"


def render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
           tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None,
           chat_template: str | None = None) -> str:
    """The template (chat_template, else the tokenizer's) applied to checked messages and tools
    (a string); ValueError if there is none, ChatTemplateError if rendering fails: a template is
    code, and whatever it raises (a Jinja error, a division by zero, the sandbox's range limit,
    a recursion too deep) is the template's failure on these messages, not the server's."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so no chat template")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template")
    given = {} if chat_template is None else {"chat_template": chat_template}
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **given,
                                             **(template_kwargs or {}))
    except Exception as exc:  # noqa: BLE001 (see the docstring)
        raise ChatTemplateError(f"the chat template rejected the messages: {type(exc).__name__}: {exc}") from None


def load_chat_template(value: str) -> str:
    """A chat template given as vLLM's --chat-template takes it: the path of a file holding
    it, or the template's text itself (anything with a brace or a line break in it).
    ValueError for a path to no file."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"chat template {value!r}: no such file (a template given inline holds Jinja's braces)")


class _Placeholders:
    """Unique placeholders standing for client text in the rendered template."""

    def __init__(self, tokenizer: Any) -> None:
        self.nonce = secrets.token_hex(8)
        self.text: dict[str, str] = {}  # placeholder -> the text it stands for, as rendered
        self.markers = _special_token_texts(tokenizer)

    def new(self, text: str) -> str:
        holder = f"NANOVLLMCONTENT{self.nonce}N{len(self.text)}X"
        self.text[holder] = text
        return holder

    def guard(self, value: Any, as_json: bool) -> Any:
        """`value` with each string (key or value) that holds special-token text replaced by a
        placeholder standing for that string (JSON-escaped if `as_json`)."""
        if isinstance(value, str):
            if not any(m in value for m in self.markers):
                return value
            return self.new(json.dumps(value, ensure_ascii=False)[1:-1] if as_json else value)
        if isinstance(value, dict):
            return {self.guard(k, as_json): self.guard(v, as_json) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.guard(v, as_json) for v in value]
        return value

    def pattern(self) -> str:
        return f"(NANOVLLMCONTENT{self.nonce}N\\d+X)"


def _special_token_texts(tokenizer: Any) -> list[str]:
    texts = set(getattr(tokenizer, "all_special_tokens", None) or [])
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            texts.add(token.content)
    return sorted(t for t in texts if t)


def chat_prompt_ids(
    tokenizer: Any, messages: Any, add_generation_prompt: bool = True, parse_special_tokens: bool = False,
    tools: Any = None, template_kwargs: Any = None, continue_final_message: bool = False,
    add_special_tokens: bool = False, chat_template: str | None = None,
) -> list[int]:
    """Prompt token ids for `messages` (and `tools`, `template_kwargs`: see the module
    docstring). The template holds any BOS, so nothing is added around it unless
    add_special_tokens (vLLM's): then what the tokenizer adds to a text of its own (a BOS) goes
    before it, as vLLM hands the flag to the tokenizer.
    continue_final_message (vLLM's, Hugging Face's): the prompt ends with the final message's
    text, without what the template closes it with, so that the model goes on with it.
    chat_template: a Jinja template to render instead of the tokenizer's."""
    ids = _chat_ids(tokenizer, messages, add_generation_prompt, parse_special_tokens, tools, template_kwargs,
                    continue_final_message, chat_template)
    return tokenizer.encode("", add_special_tokens=True) + ids if add_special_tokens else ids


def _chat_ids(tokenizer: Any, messages: Any, add_generation_prompt: bool, parse_special_tokens: bool, tools: Any,
              template_kwargs: Any, continue_final_message: bool, chat_template: str | None) -> list[int]:
    """chat_prompt_ids without the tokenizer's own special tokens: the template's ids."""
    messages = check_messages(messages)
    try:
        tools = check_tools(tools)
    except (TypeError, ValueError) as exc:
        raise ToolsError(str(exc)) from None
    template_kwargs = check_template_kwargs(template_kwargs)
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    if parse_special_tokens:
        text = render(tokenizer, messages, add_generation_prompt, tools, template_kwargs, chat_template)
        if continue_final_message:
            text = _cut_after(text, messages[-1]["content"])
        return tokenizer.encode(text, add_special_tokens=False)
    # Client text that holds special-token text stands in the rendered template as a placeholder
    # and is tokenized apart; the rest is tokenized with the template's text around it, as
    # transformers tokenizes a rendered chat (whitespace joins across their boundary).
    holders = _Placeholders(tokenizer)
    held = []
    for i, m in enumerate(messages):
        # The final message to continue gets a placeholder even if empty: the prompt ends there.
        final_and_empty = continue_final_message and i == len(messages) - 1 and not m["content"]
        m = {**m, "content": holders.new("") if final_and_empty else holders.guard(m["content"], as_json=False)}
        if "tool_calls" in m:
            m["tool_calls"] = holders.guard(m["tool_calls"], as_json=True)
        held.append(m)
    text = render(tokenizer, held, add_generation_prompt, holders.guard(tools, as_json=True),
                  holders.guard(template_kwargs, as_json=False), chat_template)
    if continue_final_message:
        text = _cut_after(text, held[-1]["content"])
    ids: list[int] = []
    for j, piece in enumerate(re.split(holders.pattern(), text)):
        if not piece:
            continue
        if j % 2:  # a placeholder: client text, special-token text kept as text
            ids += tokenizer.encode(holders.text[piece], add_special_tokens=False, split_special_tokens=True)
        else:  # the template's own text: its markers are special tokens
            ids += tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=False)
    return ids


def _cut_after(text: str, final: str) -> str:
    """The rendered chat up to the end of the final message's text (its last occurrence)."""
    if not final:
        raise ValueError("continue_final_message: the final message has no text to continue")
    end = text.rfind(final)
    if end < 0:
        raise ValueError("continue_final_message: the chat template does not keep the final message's text, so "
                         "the prompt cannot end with it")
    return text[: end + len(final)]
