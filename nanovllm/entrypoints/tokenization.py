"""`/tokenize` and `/detokenize`, with vLLM's request and response shapes.

Routers and gateways (vllm-router, the Gateway API Inference Extension) and clients that budget
tokens ask a replica to count with its own tokenizer and chat template, so the shapes are
vLLM's: `{"prompt"}` or `{"messages"}` -> `{"tokens", "count", "max_model_len"}`, and
`{"tokens"}` -> `{"prompt"}`; `"return_token_strs": true` adds each token's string (`token_strs`,
the tokenizer's own pieces, as vLLM's). A chat request is tokenized exactly as /v1/chat/completions
tokenizes it (nanovllm/chat.py), so the count is what generation will see. Bad input is a 400
naming the field.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from pydantic import StrictBool, StrictInt, ValidationError

from nanovllm.chat import chat_prompt_ids, error_field
from nanovllm.entrypoints.protocol import ChatMessage, _Request, _Response, bad_request


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage]
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # the server checks it against --trust-request-chat-template
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False  # the template holds any BOS
    return_token_strs: StrictBool = False


class ChatOptions(NamedTuple):
    """How the server renders a chat, as for /v1/chat/completions: whether special-token text
    in contents is parsed (--parse-special-tokens-in-chat), and the request's own template
    where the server accepts one."""

    parse_special_tokens: bool = False
    chat_template: str | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[StrictInt]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Response):
    prompt: str


def _validate(cls: type[_Request], body: Any) -> Any:
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or None
        raise bad_request(f"{where}: {err['msg']}" if where else err["msg"], param=where) from None


def parse_tokenize(body: Any) -> TokenizeCompletionRequest | TokenizeChatRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object with 'prompt' or 'messages'")
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("give exactly one of 'prompt' (text) or 'messages' (a chat)", param="prompt")
    return _validate(TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest, body)


def parse_detokenize(body: Any) -> DetokenizeRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object with 'tokens'")
    return _validate(DetokenizeRequest, body)


def tokenize(tokenizer: Any, req: TokenizeCompletionRequest | TokenizeChatRequest, max_model_len: int,
             chat: ChatOptions | None = None) -> TokenizeResponse:
    """Token ids of a prompt or chat (runs on the server's tokenizer thread); a chat is rendered
    with `chat`'s options (default: none)."""
    if tokenizer is None:
        raise bad_request("this model has no tokenizer")
    if isinstance(req, TokenizeChatRequest):
        chat = chat or ChatOptions()
        messages = [m.for_template() for m in req.messages]
        try:
            ids = chat_prompt_ids(tokenizer, messages, req.add_generation_prompt,
                                  parse_special_tokens=chat.parse_special_tokens, tools=req.tools,
                                  template_kwargs=req.chat_template_kwargs,
                                  continue_final_message=req.continue_final_message,
                                  add_special_tokens=req.add_special_tokens, chat_template=chat.chat_template)
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc), param=error_field(exc, request_template=chat.chat_template is not None)) from None
    else:
        ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    token_strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=token_strs)


def detokenize(tokenizer: Any, req: DetokenizeRequest, vocab_size: int) -> DetokenizeResponse:
    if tokenizer is None:
        raise bad_request("this model has no tokenizer")
    for i, t in enumerate(req.tokens):
        if not 0 <= t < vocab_size:
            raise bad_request(f"tokens[{i}]={t} is outside the vocabulary [0, {vocab_size})", param="tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(req.tokens))
