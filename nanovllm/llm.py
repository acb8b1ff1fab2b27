"""The offline API, shaped like vLLM's: `LLM(model, **options).generate(prompts, params)`.

`generate` takes strings or token-id lists (or vLLM's prompt dicts, `{"prompt": text}` and
`{"prompt_token_ids": ids}`) and one SamplingParams or one per prompt, runs the
engine until every request is done, and returns outputs in prompt order. `chat` applies the
model's chat template first. `stream` yields incremental outputs as they are produced.

Calls may interleave (two streams read in turns, a generate while a stream is open): each
engine step serves every open request, so a call keeps the newest output of the other calls'
requests that its steps produce (`_held`), and each call takes its own from there first.
"""
from __future__ import annotations

import itertools
import logging
import numbers
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from nanovllm.chat import chat_prompt_ids, check_messages, render
from nanovllm.config import EngineConfig
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.outputs import RequestOutput, ranked_logprobs
from nanovllm.gc_pause import collections_paused
from nanovllm.sampling_params import SamplingParams
from nanovllm.text import check_text

logger = logging.getLogger("nanovllm")

Prompt = str | list[int]
# vLLM's prompt dicts (TextPrompt, TokensPrompt), and the one key each carries here.
PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _unwrap_prompt(prompt: Any, i: int) -> Any:
    """A vLLM prompt dict ({"prompt": text} or {"prompt_token_ids": ids}) -> its text or ids;
    anything else as it is. ValueError naming the prompt for a dict of other keys."""
    if not isinstance(prompt, dict):
        return prompt
    given = [k for k in PROMPT_KEYS if k in prompt]
    others = sorted(set(prompt) - set(PROMPT_KEYS))
    if len(given) != 1 or others:
        raise ValueError(f"prompt {i}: a prompt dict holds one of {PROMPT_KEYS} (vLLM's TextPrompt or TokensPrompt); "
                         f"got keys {sorted(prompt)}" + (" (not supported: " + ", ".join(others) + ")" if others else ""))
    return prompt[given[0]]


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        with collections_paused():
            self.engine = LLMEngine(EngineConfig.from_kwargs(model, **kwargs))
        self.config = self.engine.config  # with the settings the engine resolved (max_model_len)
        self._ids = itertools.count()
        self._open: set[str] = set()  # the requests a generate or stream call is waiting on
        self._held: dict[str, RequestOutput] = {}  # open request id -> its newest output, stepped by another call
        # Time to first token of the last generate() call, seconds: {"avg", "min", "max"} (nano-vllm's bench.py reads it).
        self.last_ttft_stats: dict[str, float] | None = None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's sampling defaults (its generation_config.json or GGUF
        sampling metadata, unless LLM(generation_config="none")), the rest SamplingParams'
        own; what `generate` and `chat` use when given no sampling_params, as in vLLM."""
        return SamplingParams(**self.engine.generation_defaults)

    # ---- helpers -------------------------------------------------------------------------
    def _normalize(self, prompts: Prompt | Sequence[Prompt], sampling_params) -> tuple[list[Prompt], list[SamplingParams]]:
        """(prompts, one SamplingParams per prompt); TypeError/ValueError naming the argument."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(
                f"prompts must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}"
            )
        prompts = [_unwrap_prompt(p, i) for i, p in enumerate(prompts)]
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                check_text(p, f"prompt {i}")
            elif not isinstance(p, (list, tuple)):
                raise TypeError(f"prompt {i} must be a string or a list of token ids, got {type(p).__name__}")
        if sampling_params is None:
            params = [self.get_default_sampling_params()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
            bad = next((p for p in params if not isinstance(p, SamplingParams)), None)
            if bad is not None:
                raise TypeError(f"sampling_params must hold SamplingParams objects, got a {type(bad).__name__}")
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        else:
            raise TypeError(
                f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}"
            )
        return prompts, params

    def _add_all(self, prompts: list[Prompt], params: list[SamplingParams], stream: bool) -> list[str]:
        # add_request validates each prompt; if one is bad, the ones already added are aborted,
        # so the engine is left as it was.
        request_ids = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                rid = f"gen-{next(self._ids)}"
                try:
                    self.engine.add_request(rid, p, sp, stream=stream)
                except ValueError as exc:
                    raise ValueError(f"prompt {i}: {exc}") from None
                request_ids.append(rid)
        except BaseException:
            for rid in request_ids:
                self.engine.abort_request(rid)
            raise
        return request_ids

    def _outputs(self, mine: set[str]) -> list[RequestOutput]:
        """The next outputs of the requests in `mine` (cumulative, so a held one is the newest):
        those another call's steps produced, else those of one engine step, whose outputs of
        other open requests are held for their callers. Empty once the engine has nothing left."""
        held = [self._held.pop(rid) for rid in [rid for rid in self._held if rid in mine]]
        if held or not self.engine.has_unfinished_requests():
            return held
        outputs = []
        for out in self.engine.step():
            if out.request_id in mine:
                outputs.append(out)
            elif out.request_id in self._open:
                self._held[out.request_id] = out
        return outputs

    @staticmethod
    def _with_ranked_logprobs(out: RequestOutput, params: SamplingParams) -> RequestOutput:
        """out with its logprobs entries as `Logprob`s (vLLM's `.logprob` / `.rank` read too)."""
        if params.logprobs is not None:
            for c in out.outputs:
                if c.logprobs is not None:
                    c.logprobs = [ranked_logprobs(entry, params.logprobs) for entry in c.logprobs]
        return out

    def _close(self, request_ids) -> None:
        for rid in request_ids:
            self._open.discard(rid)
            self._held.pop(rid, None)

    # ---- public API ----------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        prompts, params = self._normalize(prompts, sampling_params)
        request_ids = self._add_all(prompts, params, stream=False)
        pending = set(request_ids)
        self._open |= pending
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        try:
            while pending:
                outputs = self._outputs(pending)
                if not outputs and not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"the engine finished without outputs for {len(pending)} request(s)")
                for out in outputs:
                    if out.finished:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
                stats = self.engine.last_step
                if stats.seconds > 0:
                    if stats.num_prefill_tokens:
                        prefill_tps = stats.num_prefill_tokens / stats.seconds
                    elif stats.num_decode_tokens:
                        decode_tps = stats.num_decode_tokens / stats.seconds
                    bar.set_postfix(prefill=f"{prefill_tps:.0f}tok/s", decode=f"{decode_tps:.0f}tok/s", refresh=False)
        except BaseException:
            for rid in request_ids:
                self.engine.abort_request(rid)
            raise
        finally:
            self._close(request_ids)
            bar.close()
        ordered = [self._with_ranked_logprobs(results[rid], sp) for rid, sp in zip(request_ids, params)]
        ttfts = [
            o.metrics["first_token_time"] - o.metrics["arrival_time"]
            for o in ordered
            if o.metrics.get("first_token_time") is not None
        ]
        self.last_ttft_stats = (
            {"avg": sum(ttfts) / len(ttfts), "min": min(ttfts), "max": max(ttfts)} if ttfts else None
        )
        return ordered

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield cumulative outputs of one request as tokens arrive (the last has finished=True).
        `prompt` takes the forms generate takes for one prompt (a string, token ids, vLLM's
        prompt dicts)."""
        if isinstance(sampling_params, (list, tuple)):
            raise TypeError("stream takes one SamplingParams (or None), for its one prompt")
        prompts, params_list = self._normalize(prompt, sampling_params)
        if len(prompts) != 1:
            raise ValueError(f"stream takes one prompt, got {len(prompts)}")
        params = params_list[0]
        (request_id,) = self._add_all(prompts, [params], stream=True)
        mine = {request_id}
        self._open.add(request_id)
        done = False
        try:
            while not done:
                outputs = self._outputs(mine)
                if not outputs and not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"the engine finished without a final output for request {request_id}")
                for out in outputs:
                    done = out.finished
                    yield self._with_ranked_logprobs(out, params)
        finally:
            self._close(mine)
            if not done:
                self.engine.abort_request(request_id)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The chat template's text for `messages` (checked: nanovllm/chat.py). To generate, use
        `chat`: it tokenizes message contents so that special-token text in them stays text."""
        return render(self.engine.tokenizer, check_messages(messages), add_generation_prompt=True)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        parse_special_tokens: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them. Special-token text inside a
        message stays text unless parse_special_tokens (nanovllm/chat.py). `tools` (OpenAI's
        tool definitions) and `chat_template_kwargs` (e.g. {"enable_thinking": False}) go to
        the chat template, and so does add_generation_prompt (vLLM's: False leaves out the
        opening of the assistant's turn); continue_final_message (vLLM's; with
        add_generation_prompt=False) ends the prompt inside the final message, which the reply
        goes on with. chat_template (vLLM's): a Jinja template to use instead of the model's.
        The replies are returned as text."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError("messages must be a non-empty list of messages or a list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [
            chat_prompt_ids(self.engine.tokenizer, conv, add_generation_prompt, parse_special_tokens=parse_special_tokens,
                            tools=tools, template_kwargs=chat_template_kwargs,
                            continue_final_message=continue_final_message, chat_template=chat_template)
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefixes (e.g. between benchmark runs); False while requests are running."""
        return self.engine.block_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
