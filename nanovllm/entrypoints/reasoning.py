"""Reasoning in generated text: `<think>...</think>` split from the answer, as a stream.

`ReasoningParser.feed(delta)` returns the reasoning and content text the new text settles;
`finish()` what the end of the output settles. Text that may be the start of a marker is held
back until the next delta decides it, so the deltas add up to the whole text parsed at once.

Parsers, by vLLM's names (`--reasoning-parser`):
- `qwen3`: an output that begins with `<think>` reasons until `</think>`, then answers (the
  whitespace between the two is dropped); one
  that does not is all answer (Qwen3 with `enable_thinking: false`, whose template closes an
  empty think block in the prompt). When the rendered prompt already ends in `<think>` (templates
  that open the block for the model), the output starts inside it.
- `deepseek_r1`: everything before `</think>` is reasoning (a leading `<think>` is dropped);
  an output without `</think>` is all reasoning.
"""
from __future__ import annotations

from nanovllm.entrypoints.tool_parsers import ParsedDelta, held_suffix

START = "<think>"
END = "</think>"
PARSERS = ("qwen3", "deepseek_r1")


class ReasoningParser:
    def __init__(self, name: str, prompt_opens_reasoning: bool = False) -> None:
        if name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(PARSERS)}")
        self._starts_in_reasoning = name == "deepseek_r1" or prompt_opens_reasoning
        self._state = "start"  # start -> reasoning -> answer -> content, or start -> content
        self._buffer = ""

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        while True:
            buf = self._buffer
            if self._state == "start":
                if len(buf) < len(START) and START.startswith(buf):
                    return out
                if buf.startswith(START):
                    self._buffer = buf[len(START):]
                    self._state = "reasoning"
                else:
                    self._state = "reasoning" if self._starts_in_reasoning else "content"
                continue
            if self._state == "answer":  # whitespace between </think> and the answer is dropped
                self._buffer = buf = buf.lstrip()
                if not buf:
                    return out
                self._state = "content"
            if self._state == "content":
                out.content += buf
                self._buffer = ""
                return out
            end = buf.find(END)
            if end < 0:
                ready = len(buf) - held_suffix(buf, END)
                out.reasoning += buf[:ready]
                self._buffer = buf[ready:]
                return out
            out.reasoning += buf[:end]
            self._buffer = buf[end + len(END):]
            self._state = "answer"

    def finish(self) -> ParsedDelta:
        buf, self._buffer = self._buffer, ""
        if self._state == "reasoning" or (self._state == "start" and self._starts_in_reasoning):
            return ParsedDelta(reasoning=buf)
        return ParsedDelta(content=buf.lstrip() if self._state == "answer" else buf)


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Whether a rendered prompt ending in `prompt_tail` leaves a think block open."""
    tail = prompt_tail.rstrip()
    return tail.endswith(START)
