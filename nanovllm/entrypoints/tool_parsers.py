"""Tool calls in generated text: streaming parsers fed text deltas.

Each parser is a small state machine: `feed(delta)` returns what the new text settles (content
text, and `ToolCallDelta`s in OpenAI's incremental shape: a call's first delta carries its
index, id and name, later ones fragments of its arguments), `finish()` what the end of the
output settles. Text that may still turn out to be part of a call marker is held back until the
next delta decides it. The whole text parsed at once (`parse_whole`) is the same machine fed a
single delta, so a stream's deltas always add up to the unstreamed answer.

A call is a JSON object with a string `"name"` and the arguments under `"arguments"` or
`"parameters"`. The arguments are sent as the model wrote them (the raw JSON text of that
value), so fragments can go out before the object is complete. A name is announced only once
its string is complete; a call object that ends (or proves malformed) without a name is passed
on as content, text and all.

Parsers, by vLLM's names (`--tool-call-parser`):
- `hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, anywhere in the output; the text around them is content.
- `llama3_json` (Llama 3.1 / 3.2): the output is `{"name": ..., "parameters": {...}}` objects
  separated by `;`, optionally after `<|python_tag|>`; an output that starts with anything else
  is content.
Two more shapes come from constrained decoding (tool_choice `required` / a named function):
`RequiredCallsParser`, a JSON array of `{"name", "parameters"}` objects, and
`NamedCallParser`, where the whole output is the arguments of one given function.

Whitespace-only content next to a call (the newlines between blocks) is dropped; content keeps
its whitespace otherwise.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Callable

ARGUMENT_KEYS = ("arguments", "parameters")
_DECODER = json.JSONDecoder()
_WHITESPACE = re.compile(r"[ \t\n\r]*")


def new_call_id() -> str:
    """An id in OpenAI's shape: "call_" and 24 hex digits."""
    return f"call_{secrets.token_hex(12)}"


@dataclass
class ToolCallDelta:
    """One step of a streamed call: `id` and `name` in the call's first delta only."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


@dataclass
class ParsedDelta:
    """What a piece of output settles: content text, reasoning text, tool call steps."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: "ParsedDelta") -> "ParsedDelta":
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls
        return self

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


@dataclass
class ParsedOutput:
    """A whole output: content (None when empty), reasoning (None when absent), calls."""

    content: str | None
    reasoning: str | None
    tool_calls: list[ToolCall]


def merge_deltas(deltas: list[ParsedDelta]) -> ParsedOutput:
    """The whole output that a sequence of deltas adds up to."""
    content = "".join(d.content for d in deltas)
    reasoning = "".join(d.reasoning for d in deltas)
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        for step in d.tool_calls:
            if step.index not in calls:
                calls[step.index] = ToolCall(step.id or "", step.name or "", "")
            calls[step.index].arguments += step.arguments
    tool_calls = [calls[i] for i in sorted(calls)]
    if tool_calls and not content.strip():
        content = ""
    return ParsedOutput(content or None, reasoning or None, tool_calls)


def held_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker` (text to
    hold back: the next delta may complete the marker)."""
    start = text.find(marker[0], max(0, len(text) - len(marker) + 1))
    if start < 0:
        return 0
    for size in range(len(text) - start, 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


# ---- one call object -------------------------------------------------------------------------
@dataclass
class ObjectScan:
    """What is known of a JSON object from a prefix of its text.

    state: "partial" (more text may complete it), "complete" (`end` is one past its closing
    brace) or "invalid" (no continuation makes it an object; `end` is where it goes wrong).
    `name`: the first "name" member, once its string is complete. `args_start`: where the
    arguments value begins; `args_end`: where it ends, once it is known to be complete."""

    state: str
    end: int = 0
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    args_tracker: "ValueEnd | None" = None


class ValueEnd:
    """Where a JSON object, array or string that begins at `start` ends, found by reading each
    character once however many times the growing text is asked about (brackets and quotes,
    outside strings; escapes inside them). The value's own syntax is checked by raw_decode once
    its end is found."""

    _PLAIN = re.compile(r'[^"\\{}\[\]]+')
    _PLAIN_IN_STRING = re.compile(r'[^"\\]+')

    def __init__(self, start: int) -> None:
        self.start = start
        self.pos = start  # text before this has been read
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.end: int | None = None

    def advance(self, text: str) -> int | None:
        """One past the value's last character, or None while it is not finished."""
        if self.end is not None:
            return self.end
        i, n = self.pos, len(text)
        while i < n:
            if self.escaped:
                self.escaped, i = False, i + 1
                continue
            skip = (self._PLAIN_IN_STRING if self.in_string else self._PLAIN).match(text, i)
            if skip is not None:
                i = skip.end()
                continue
            c = text[i]
            i += 1
            if c == "\\":
                self.escaped = self.in_string
            elif c == '"':
                self.in_string = not self.in_string
                if not self.in_string and self.depth == 0:
                    self.pos = self.end = i
                    return i
            elif not self.in_string:
                self.depth += 1 if c in "{[" else -1
                if self.depth == 0:
                    self.pos = self.end = i
                    return i
        self.pos = i
        return None


def scan_call_object(text: str, start: int, args_end: ValueEnd | None = None) -> ObjectScan:
    """Scan the object that begins at text[start] == "{" as far as the text goes. `args_end`:
    the tracker of the arguments value from the last scan of this (shorter) text, so a long
    unfinished value is not read again; a new one is stored in the returned scan."""
    scan = ObjectScan("partial")
    n = len(text)
    i = _WHITESPACE.match(text, start + 1).end()
    if i < n and text[i] == "}":
        scan.state, scan.end = "complete", i + 1
        return scan
    while True:
        if i == n:
            return scan
        if text[i] != '"':
            scan.state, scan.end = "invalid", i
            return scan
        try:
            key, i = _DECODER.raw_decode(text, i)
        except ValueError:
            return scan  # the key's string is not finished
        i = _WHITESPACE.match(text, i).end()
        if i == n:
            return scan
        if text[i] != ":":
            scan.state, scan.end = "invalid", i
            return scan
        i = _WHITESPACE.match(text, i + 1).end()
        is_args = key in ARGUMENT_KEYS and scan.args_start is None
        if is_args:
            scan.args_start = i
        if i == n:
            return scan
        if is_args and text[i] in '{["':
            tracker = args_end if args_end is not None and args_end.start == i else ValueEnd(i)
            scan.args_tracker = tracker
            if tracker.advance(text) is None:
                return scan  # unfinished
        try:
            value, j = _DECODER.raw_decode(text, i)
        except (ValueError, RecursionError):  # (nested deeper than Python's parser goes: not JSON to us)
            if is_args and scan.args_tracker is not None and scan.args_tracker.end is not None:
                scan.args_end = scan.args_tracker.end  # whole but not JSON: what follows is not its
            return scan  # unfinished (or not JSON: decided when the call ends)
        if j == n and isinstance(value, (int, float)) and not isinstance(value, bool):
            return scan  # a number may go on
        if is_args:
            scan.args_end = j
        elif key == "name" and scan.name is None and isinstance(value, str):
            scan.name = value
        i = _WHITESPACE.match(text, j).end()
        if i == n:
            return scan
        if text[i] == "}":
            scan.state, scan.end = "complete", i + 1
            return scan
        if text[i] != ",":
            scan.state, scan.end = "invalid", i
            return scan
        i = _WHITESPACE.match(text, i + 1).end()


class _Calls:
    """The calls of one output: which have begun, and how much of each one's arguments went out."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        self.new_id = new_id
        self.count = 0  # calls finished
        self.begun = False  # the current call's name went out
        self.sent = 0  # characters of the current call's arguments sent so far

    def step(self, name: str | None, text: str, start: int = 0, end: int | None = None) -> list[ToolCallDelta]:
        """Deltas for the current call, given its name (once known) and its arguments so far,
        text[start:end] (each time a continuation of the last: the text only grows)."""
        out = []
        if not self.begun:
            if name is None:
                return out
            self.begun = True
            out.append(ToolCallDelta(self.count, self.new_id(), name, ""))
        end = len(text) if end is None else end
        if end - start > self.sent:
            out.append(ToolCallDelta(self.count, arguments=text[start + self.sent:end]))
            self.sent = end - start
        return out

    def object_step(self, text: str, scan: ObjectScan, final: bool) -> list[ToolCallDelta]:
        """Deltas for a call object scanned from `text`; `final`: the object's text is all there."""
        if scan.args_start is not None:
            return self.step(scan.name, text, scan.args_start, scan.args_end)
        return self.step(scan.name, "{}" if final else "")

    def close(self) -> None:
        if self.begun:
            self.count += 1
        self.begun, self.sent = False, 0


class _Content:
    """Content text, with trailing whitespace held until more content follows: whitespace
    right before a call (or at the end of an output with calls) is dropped."""

    def __init__(self) -> None:
        self.pending = ""

    def add(self, text: str) -> str:
        text = self.pending + text
        kept = len(text.rstrip())
        self.pending = text[kept:]
        return text[:kept]

    def drop_pending(self) -> None:
        self.pending = ""

    def finish(self, had_calls: bool) -> str:
        text, self.pending = self.pending, ""
        return "" if had_calls else text


class ToolParser:
    """Interface: feed text deltas, then finish once."""

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self._calls = _Calls(new_id)
        self._content = _Content()

    def feed(self, text: str) -> ParsedDelta:
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        raise NotImplementedError

    @property
    def called(self) -> bool:
        """Whether any call has begun."""
        return self._calls.count > 0 or self._calls.begun


class HermesToolParser(ToolParser):
    START = "<tool_call>"
    END = "</tool_call>"

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self._buffer = ""
        self._in_call = False
        self._args_end: ValueEnd | None = None  # the current block's arguments tracker
        self._searched = 0  # the block's text before this holds no end marker

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        while True:
            if not self._in_call:
                start = self._buffer.find(self.START)
                if start < 0:
                    ready = len(self._buffer) - held_suffix(self._buffer, self.START)
                    out.content += self._content.add(self._buffer[:ready])
                    self._buffer = self._buffer[ready:]
                    return out
                out.content += self._content.add(self._buffer[:start])
                self._buffer = self._buffer[start + len(self.START):]
                self._in_call, self._searched = True, 0
                continue
            end = self._buffer.find(self.END, self._searched)
            if end < 0:
                self._searched = max(0, len(self._buffer) - len(self.END) + 1)
                body = self._buffer[:len(self._buffer) - held_suffix(self._buffer, self.END)]
                out.extend(self._call_step(body, final=False))
                return out
            out.extend(self._call_step(self._buffer[:end], final=True, closed=True))
            self._buffer = self._buffer[end + len(self.END):]
            self._in_call = False

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._in_call:  # the output ended inside a block (max_tokens)
            out.extend(self._call_step(self._buffer, final=True, closed=False))
        else:
            out.content += self._content.add(self._buffer)
        self._buffer = ""
        out.content += self._content.finish(self.called)
        return out

    def _call_step(self, body: str, final: bool, closed: bool = False) -> ParsedDelta:
        out = ParsedDelta()
        first = _WHITESPACE.match(body).end()
        scan = None
        if first < len(body) and body[first] == "{":
            scan = scan_call_object(body, first, self._args_end)
            self._args_end = scan.args_tracker
        if scan is not None:
            out.tool_calls = self._calls.object_step(body, scan, final)
            if self._calls.begun:
                self._content.drop_pending()  # whitespace before a call
        if final:
            if not self._calls.begun:  # no call in it: the block is content
                out.content += self._content.add(self.START + body + (self.END if closed else ""))
            self._calls.close()
            self._args_end = None
        return out


class JsonCallsParser(ToolParser):
    """A run of call objects: `opener`, then objects separated by `separators`, then an
    optional `closer`; an output that does not open that way is content. Text after the run
    (or after a malformed object) is content too. An output that ends, or turns to content,
    before any call begins is content as written (opener, separators and all)."""

    def __init__(self, opener: str, optional_prefix: str, separators: str, closer: str,
                 new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self.opener = opener  # "{" (the first object itself) or "["
        self.optional_prefix = optional_prefix  # e.g. "<|python_tag|>"
        self.separators = separators
        self.closer = closer
        self._buffer = ""
        self._state = "start"  # start -> between <-> object; -> content
        self._args_end: ValueEnd | None = None  # the current object's arguments tracker
        self._written = ""  # the output so far, kept until a call begins

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        if not self.called and self._state != "content":
            self._written += text
        return self._advance(final=False)

    def finish(self) -> ParsedDelta:
        out = self._advance(final=True)
        if self._state == "object":
            scan = scan_call_object(self._buffer, 0, self._args_end)
            out.extend(self._end_object(scan, final=True))
        if self._state != "content":
            self._to_content()
        out.content += self._content.add(self._buffer)
        self._buffer = ""
        out.content += self._content.finish(self.called)
        return out

    def _advance(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            buf = self._buffer
            if self._state == "content":
                out.content += self._content.add(buf)
                self._buffer = ""
                return out
            if self._state == "start":
                body = buf.lstrip()
                if not body or (not final and len(body) < len(self.optional_prefix)
                                and self.optional_prefix.startswith(body)):
                    return out
                if self.optional_prefix and body.startswith(self.optional_prefix):
                    body = body[len(self.optional_prefix):].lstrip()
                    if not body:
                        self._buffer = ""
                        return out
                if body[0] != self.opener:
                    self._to_content()
                    continue
                self._buffer = body if self.opener == "{" else body[1:]
                self._state = "between"
                continue
            if self._state == "between":
                i = 0
                while i < len(buf) and (buf[i].isspace() or buf[i] in self.separators):
                    i += 1
                self._buffer = buf = buf[i:]
                if not buf:
                    return out
                if buf[0] == "{":
                    self._state = "object"
                    continue
                if self.closer and buf[0] == self.closer:
                    self._buffer = buf[1:]
                self._to_content()
                continue
            scan = scan_call_object(buf, 0, self._args_end)  # state "object"
            self._args_end = scan.args_tracker
            if scan.state == "partial":
                out.tool_calls += self._calls.object_step(buf, scan, final=False)
                return out
            out.extend(self._end_object(scan, final=True))

    def _end_object(self, scan: ObjectScan, final: bool) -> ParsedDelta:
        """The object at the buffer's start ended (complete, malformed, or the output ended)."""
        out = ParsedDelta()
        buf = self._buffer
        self._args_end = None
        end = len(buf) if scan.state == "partial" else scan.end
        out.tool_calls = self._calls.object_step(buf[:end], scan, final)
        if self._calls.begun:
            self._calls.close()
            self._buffer = buf[end:]
            self._state = "between" if scan.state == "complete" else "content"
        else:  # no name: this object, and all after it, is content
            self._to_content()
        return out

    def _to_content(self) -> None:
        """The rest of the output is content: with no call before it, the whole output as written."""
        if not self.called:
            self._buffer = self._written
        self._state = "content"


def llama3_json_parser(new_id: Callable[[], str] = new_call_id) -> JsonCallsParser:
    return JsonCallsParser("{", "<|python_tag|>", ";", "", new_id)


class RequiredCallsParser(JsonCallsParser):
    """tool_choice "required": the output is constrained to a JSON array of
    {"name", "parameters"} objects."""

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__("[", "", ",", "]", new_id)


class NamedCallParser(ToolParser):
    """tool_choice naming a function: the output is constrained to its arguments."""

    def __init__(self, name: str, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self.name = name
        self._arguments = ""

    def feed(self, text: str) -> ParsedDelta:
        self._arguments += text
        return ParsedDelta(tool_calls=self._calls.step(self.name, self._arguments))

    def finish(self) -> ParsedDelta:
        return ParsedDelta(tool_calls=self._calls.step(self.name, self._arguments))


PARSERS: dict[str, Callable[..., ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": llama3_json_parser,
}


def detect_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's tool format calls for, or None if it shows none."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|python_tag|>" in chat_template or "Environment: ipython" in chat_template:
        return "llama3_json"
    return None


def parse_whole(parser: ToolParser, text: str) -> ParsedOutput:
    """A whole output parsed at once (the same machine, one delta)."""
    return merge_deltas([parser.feed(text), parser.finish()])
