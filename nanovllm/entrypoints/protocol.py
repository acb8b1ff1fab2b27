"""The OpenAI wire format: request and response models, and OpenAI-shaped errors.

Requests are parsed by pydantic; anything it rejects becomes a 400 with OpenAI's error body
(the server overrides FastAPI's 422). A field sent as null takes its default, as OpenAI marks
its optional fields nullable. Unknown request fields are ignored, as OpenAI clients send
fields this engine has no use for (`user`, `metadata`, ...); fields we know but cannot honour
(suffix, vLLM's allowed_token_ids, bad_words, ...) are rejected with a 400 naming them rather
than silently ignored. Sampling
values are checked once, by `SamplingParams`, whose ValueError names the field;
`sampling_params()` turns that into an `OpenAIError` with `param` set.

Besides OpenAI's parameters, requests take vLLM's extras: top_k, min_p, repetition_penalty,
ignore_eos, min_tokens, stop_token_ids, skip_special_tokens, include_stop_str_in_output,
truncate_prompt_tokens, return_tokens_as_token_ids, prompt_logprobs (send them with the openai
client's `extra_body`). A sampling field a request leaves unset takes the model's default where it has
one (`apply_generation_defaults`: vLLM's `--generation-config auto`).

Structured output: `response_format` (`{"type": "json_object"}`, or `{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}`) and vLLM's `structured_outputs` (`json`, `regex`,
`choice`, `grammar` or `json_object`), on both endpoints; at most one of the two per request.
The grammar itself is checked by the server before the request reaches the engine
(OpenAIServer._check_grammar: a 400 naming the field).

Numbers and flags are strict: `true` is not the integer 1 and `1` is not a bool (SamplingParams
refuses bools as numbers too). Strings with lone surrogates (JSON's "\ud800") are refused here,
naming the field, as tokenizers cannot encode them. Chat roles are system, developer (OpenAI's
newer name for system, given to the template as system), user, assistant and tool; `tools` and
`tool_choice` are OpenAI's (entrypoints/tools.py turns them into a plan), the deprecated
`functions` / `function_call` are refused. Per-request caps that depend on the
server's configuration (n, prompts per request) are checked by `check_limits`.
"""
from __future__ import annotations

import re
import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
    model_serializer,
    model_validator,
)

from nanovllm.chat import ROLES, content_text
from nanovllm.sampling_params import (
    MAX_ADDITIVE_PENALTY,
    MAX_SEED,
    MAX_TEMPERATURE,
    SamplingParams,
    StructuredOutputsParams,
)
from nanovllm.text import check_text


# The largest integer a request field may hold: what the engine core's messages carry (msgpack's
# int64). Larger counts mean nothing more (max_tokens is cut to the context), but would not cross.
MAX_REQUEST_INT = 2**63 - 1
# The most bad_words a request may give: each is tokenized (twice) as the engine core admits the
# request, and each step of its sequences checks every one against the output's tail.
MAX_BAD_WORDS = 1024


class OpenAIError(Exception):
    """An error to send as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(
        self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def _check_strings(value: Any, where: str) -> None:
    """Every string in `value` (keys too) through check_text; without recursion, as a value
    (a schema) may nest as deep as the JSON parser takes."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            check_text(item, where)
        elif isinstance(item, (list, tuple)):
            todo += item
        elif isinstance(item, dict):
            todo += [*item.keys(), *item.values()]


# ---- requests --------------------------------------------------------------------------------
class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        # OpenAI's API marks its optional fields nullable, and clients send null for a field
        # they leave unset (the openai client sends n=None as null): it takes the default.
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any, info: Any) -> Any:
        _check_strings(value, info.field_name)
        return value


class StreamOptions(_Request):
    include_usage: StrictBool = False
    # vLLM's: every chunk of a choice carries usage so far (that choice's completion tokens).
    continuous_usage_stats: StrictBool = False


class JsonSchemaFormat(_Request):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs` request field: exactly one of these."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None


class _SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # The ranges are SamplingParams' (which checks them again), stated here for the OpenAPI schema.
    model: str | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_REQUEST_INT)
    stop: str | list[str] | None = None
    seed: StrictInt | None = Field(None, ge=0, le=MAX_SEED)
    temperature: StrictFloat | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: StrictFloat | None = Field(None, gt=0, le=1)
    max_tokens: StrictInt | None = Field(None, ge=1, le=MAX_REQUEST_INT)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: StrictFloat | None = Field(None, ge=-MAX_ADDITIVE_PENALTY, le=MAX_ADDITIVE_PENALTY)
    frequency_penalty: StrictFloat | None = Field(None, ge=-MAX_ADDITIVE_PENALTY, le=MAX_ADDITIVE_PENALTY)
    # Token id (a decimal string, as JSON keys are strings) -> bias in [-100, 100].
    logit_bias: dict[str, StrictFloat] | None = None
    # vLLM-style extras.
    top_k: StrictInt | None = Field(None, ge=-1, le=MAX_REQUEST_INT)
    min_p: StrictFloat | None = Field(None, ge=0, le=1)
    repetition_penalty: StrictFloat | None = Field(None, gt=0)
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(0, ge=0, le=MAX_REQUEST_INT)
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    include_stop_str_in_output: StrictBool = False
    # vLLM's: the request runs on the last k tokens of its prompt (as tokenized, chat template
    # included); -1: as many as max_model_len leaves room for (sampling_params.truncate_prompt).
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=-1, le=MAX_REQUEST_INT)
    # vLLM's: logprobs name their tokens "token_id:<id>" rather than by their text.
    return_tokens_as_token_ids: StrictBool = False
    # vLLM's: only these token ids may be sampled; and words that may not be generated
    # (SamplingParams.allowed_token_ids, bad_words).
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)
    # vLLM's: each prompt token's logprob and the k likeliest at its position (SamplingParams
    # checks the value; not with stream, as vLLM).
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=20)

    def check_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs are not available when stream is true", param="prompt_logprobs")

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation(cls, value: int | None) -> int | None:
        if value == 0:  # checked here: the server applies it itself (SamplingParams never sees it)
            raise ValueError("must be an integer >= 1, or -1 (as many as the context allows)")
        return value

    @property
    def structured_param(self) -> str:
        """The request field a grammar error is about."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The output constraint of response_format or structured_outputs (400 naming the field)."""
        fmt = self.response_format
        constrained = fmt is not None and fmt.type != "text"
        if constrained and self.structured_outputs is not None:
            raise bad_request("give response_format or structured_outputs, not both", param="structured_outputs")
        try:
            if self.structured_outputs is not None:
                so = self.structured_outputs
                return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                               json_object=so.json_object)
            if not constrained:
                return None
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise bad_request("response_format of type json_schema needs json_schema.schema",
                                  param="response_format")
            return StructuredOutputsParams(json=fmt.json_schema.schema_)
        except ValueError as exc:
            raise bad_request(str(exc), param=self.structured_param) from None

    def check_limits(self, max_n: int, max_prompts: int) -> None:
        """The server's per-request caps (ServerLimits), as 400s naming the field."""
        if self.n > max_n:
            raise bad_request(f"n must be at most {max_n} on this server (got {self.n})", param="n")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def wanted_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs of this request."""
        return self.prompt_logprobs

    def _logit_bias(self, vocab_size: int) -> dict[int, float] | None:
        """logit_bias with int keys; a key that is not a token id of this model is a 400."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            if not key.isascii() or not key.isdigit() or int(key) >= vocab_size:
                raise bad_request(f"logit_bias keys must be token ids in [0, {vocab_size}) (got {key!r})",
                                  param="logit_bias")
            out[int(key)] = bias
        return out

    def sampling_params(self, max_tokens: int, logprobs: int | None, vocab_size: int,
                        model_defaults: dict[str, Any] | None = None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """SamplingParams for this request; invalid values raise a 400 naming the parameter.
        max_tokens: the server's default where the request gives none; model_defaults: the
        model's sampling defaults (LLMEngine.generation_defaults), which come before it;
        structured_outputs: a constraint on the output (tool_choice required / named).
        truncate_prompt_tokens is left out: the server cuts the prompts itself
        (OpenAIServer._truncate) and hands the engine the kept ids."""
        if self.stop_token_ids and any(isinstance(t, int) and not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise bad_request(f"stop_token_ids must be token ids in [0, {vocab_size})", param="stop_token_ids")
        if self.allowed_token_ids and any(not 0 <= t < vocab_size for t in self.allowed_token_ids):
            raise bad_request(f"allowed_token_ids must be token ids in [0, {vocab_size})", param="allowed_token_ids")
        given = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                     presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                     repetition_penalty=self.repetition_penalty, max_tokens=self.requested_max_tokens)
        fields = apply_generation_defaults(given, model_defaults or {}, dict(max_tokens=max_tokens))
        structured = self._structured_outputs()
        if structured_outputs is not None:
            if structured is not None:
                raise bad_request("tool_choice 'required' or a named function constrains the output itself; "
                                  f"drop {self.structured_param}", param=self.structured_param)
            structured = structured_outputs
        try:
            return SamplingParams(
                **fields,
                logit_bias=self._logit_bias(vocab_size),
                allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words,
                seed=self.seed,
                min_tokens=self.min_tokens,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                n=self.n,
                skip_special_tokens=self.skip_special_tokens,
                structured_outputs=structured,
                include_stop_str_in_output=self.include_stop_str_in_output,
                prompt_logprobs=self.wanted_prompt_logprobs,
            )
        except ValueError as exc:
            message = str(exc)
            match = re.match(r"SamplingParams\.(\w+):", message)
            param = match.group(1) if match else None
            if param == "max_tokens" and isinstance(self, ChatCompletionRequest) and self.max_completion_tokens is not None:
                param = "max_completion_tokens"
            if param == "logprobs" and isinstance(self, ChatCompletionRequest):
                param = "top_logprobs"
            raise bad_request(message, param=param) from None


def apply_generation_defaults(request: dict[str, Any], model: dict[str, Any], server: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams keyword arguments: each field the request gives (not None), else the
    model's default (its generation_config.json: vLLM's `--generation-config auto`), else the
    server's own; a field none of them gives keeps SamplingParams' default (OpenAI's)."""
    fields = {**server, **model}
    fields.update((k, v) for k, v in request.items() if v is not None)
    return fields


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    # 0 with echo (OpenAI's and vLLM's): the response is the prompt alone (with its logprobs).
    max_tokens: StrictInt | None = Field(None, ge=0, le=MAX_REQUEST_INT)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    # The prompt's text before each choice's; with logprobs, the prompt tokens' logprobs before
    # the generated ones' (the first token's null), as vLLM.
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None
    # vLLM's: the tokenizer's special tokens (a BOS) before a text prompt's; false for a text
    # that holds them already.
    add_special_tokens: StrictBool = True

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens must be at least 1 (0 only with echo: the prompt alone)", param="max_tokens")
        if self.suffix:
            raise bad_request("suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported by this server (only best_of == n)", param="best_of")

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: each choice is its prompt alone (one token is generated, and
        left out, as vLLM does)."""
        return self.echo and self.max_tokens == 0

    @property
    def requested_max_tokens(self) -> int | None:
        return 1 if self.echo_only else self.max_tokens

    @property
    def wanted_prompt_logprobs(self) -> int | None:
        """prompt_logprobs, else with echo the logprobs asked for (the prompt's, echoed)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    def check_limits(self, max_n: int, max_prompts: int) -> None:
        super().check_limits(max_n, max_prompts)
        count = len(self.prompts())
        if count > max_prompts:
            raise bad_request(f"prompt holds {count} prompts; this server takes at most {max_prompts} per request",
                              param="prompt")

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one string, a batch of strings, token ids, or batches of them."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant message's calls ({"id", "type", "function": {"name", "arguments"}}) and a
    # tool message's answer to one; checked, with errors naming them, by chat.check_messages.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    function_call: Any = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}; got {role!r}")
        return role

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value: Any, info: Any) -> Any:
        if value is not None:
            raise ValueError("function_call is deprecated and not supported; use tool_calls")
        return value

    def for_template(self) -> dict[str, Any]:
        """The message as chat.chat_prompt_ids takes it."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message

    def text(self) -> str:
        content = self.content
        if isinstance(content, list):
            content = [part.model_dump() for part in content]
        try:
            return content_text(content, "content")
        except ValueError as exc:
            raise bad_request(str(exc), param="messages") from None


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=MAX_REQUEST_INT)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    functions: list[Any] | None = None
    function_call: Any = None
    add_generation_prompt: StrictBool = True
    # vLLM's: the prompt ends inside the final message, which the model goes on with.
    continue_final_message: StrictBool = False
    # vLLM's: the tokenizer's special tokens (a BOS) before the template's text, which holds its own.
    add_special_tokens: StrictBool = False
    # vLLM's field: extra variables for the chat template, e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the reply starts with the last message's content when that message has the reply's
    # role (the assistant's, or with add_generation_prompt false, the last message's own).
    echo: StrictBool = False
    # vLLM's: a Jinja template to render instead of the server's (with --trust-request-chat-template).
    chat_template: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.functions:
            raise bad_request("functions is deprecated and not supported; use tools", param="functions")
        if self.function_call not in (None, "none"):
            raise bad_request("function_call is deprecated and not supported; use tool_choice", param="function_call")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message needs add_generation_prompt false", param="continue_final_message")

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    @property
    def reply_role(self) -> str:
        """The role of the reply (vLLM's rule): the assistant's after a generation prompt, else
        the last message's, which the reply goes on with."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def echoed_text(self) -> str:
        """What `echo` puts before each choice's content: the last message's text if its role
        is the reply's, else nothing."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == self.reply_role else ""

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tool definitions as plain dicts (what chat templates take)."""
        if self.tools is None:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses -------------------------------------------------------------------------------
class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    # null (and top_logprobs null) for an echoed prompt's first token, which nothing scores
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(_Response):
    """A token's entry in vLLM's prompt_logprobs: rank 1 is the position's likeliest token."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token, null for the first, then token id (a string, as JSON
# keys are) -> PromptLogprob of the prompt token and the k likeliest.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


def _omit_if_none(data: dict[str, Any], *names: str) -> dict[str, Any]:
    for name in names:
        if data.get(name, 0) is None:
            del data[name]
    return data


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: the stop string or stop token id that ended the choice ("stop"); None otherwise
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # only where asked (prompt_logprobs)

    @model_serializer(mode="wrap")
    def _omit_unasked(self, handler: Any) -> dict[str, Any]:
        return _omit_if_none(handler(self), "prompt_logprobs")


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[TokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _omit_unused(self, handler: Any) -> dict[str, Any]:
        # reasoning_content only from a reasoning parser, tool_calls only when the model called
        data = handler(self)
        if self.reasoning_content is None:
            data.pop("reasoning_content", None)
        if not self.tool_calls:
            data.pop("tool_calls", None)
        return data


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: the stop string or stop token id that ended the choice ("stop"); None otherwise
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, of the templated prompt; only where asked

    @model_serializer(mode="wrap")
    def _omit_unasked(self, handler: Any) -> dict[str, Any]:
        return _omit_if_none(handler(self), "prompt_logprobs")


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="plain")
    def _only_present(self) -> dict[str, Any]:
        return {k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None}


class DeltaToolCall(_Response):
    """A step of a streamed call: index always; id, type and name in the call's first step."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="plain")
    def _only_present(self) -> dict[str, Any]:
        data: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            data.update(id=self.id, type=self.type or "function")
        data["function"] = self.function.model_dump()
        return data


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="plain")
    def _only_present(self) -> dict[str, Any]:
        # OpenAI sends only what changed: {"role": ...} first, then {"content": ...}, {} at the end.
        data: dict[str, Any] = {k: v for k, v in (("role", self.role), ("content", self.content),
                                                  ("reasoning_content", self.reasoning_content)) if v is not None}
        if self.tool_calls:
            data["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return data


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: the stop string or stop token id that ended the choice ("stop"); None otherwise
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "nanovllm"
    root: str | None = None  # the path the model was loaded from, as vLLM reports it
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
