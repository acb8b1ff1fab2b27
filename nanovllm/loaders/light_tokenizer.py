"""A tokenizer read from a `save_pretrained` directory without importing transformers.

Importing transformers costs about a second (it indexes every model it ships), more than the
rest of a warm start of a small model. What the engine asks of a tokenizer (encode with or
without special tokens, decode, token strings, special tokens, the chat template) needs only
the `tokenizers` library, which transformers' fast tokenizers wrap, and jinja2, which renders
their chat templates. `LightTokenizer` does those directly, as transformers does them:

- encode / decode / convert_ids_to_tokens: the `tokenizers.Tokenizer` of `tokenizer.json`
  (whose post-processor adds BOS/EOS, as save_pretrained wrote it), with `split_special_tokens`
  mapped to its `encode_special_tokens`.
- apply_chat_template: the template rendered in the same sandboxed jinja2 environment
  (trim_blocks, lstrip_blocks, loop controls, transformers' `tojson`, `raise_exception`,
  `strftime_now`, `dict`, `namespace`), with the named special tokens as variables and
  messages' None-valued keys dropped.
- Anything else (a template with `{% generation %}`, `continue_final_message`, any other
  attribute, e.g. what xgrammar reads) goes to the transformers tokenizer loaded from the same
  directory on first use (`transformers_tokenizer`).

`load_light_tokenizer` returns None for a directory it does not cover (a tokenizer class other
than the plain fast one, or spaces clean-up, which it does not reproduce): the caller then uses
transformers.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

# tokenizer_config.json classes that are exactly a tokenizer.json plus named special tokens.
PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# `{% generation %}` marks assistant text for transformers' assistant-token masks.
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def load_light_tokenizer(path: str | Path) -> LightTokenizer | None:
    """The tokenizer saved in `path`, or None when it is not a plain fast tokenizer."""
    path = Path(path)
    config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    if config.get("tokenizer_class", "PreTrainedTokenizerFast") not in PLAIN_CLASSES:
        return None
    if config.get("clean_up_tokenization_spaces") or config.get("split_special_tokens"):
        return None
    template_file = path / "chat_template.jinja"
    template = template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
    if template is not None and not isinstance(template, str):
        return None  # named templates (a dict): transformers picks among them
    return LightTokenizer(Tokenizer.from_file(str(path / "tokenizer.json")), config, template, path)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken as save_pretrained may write it
        value = value.get("content")
    return value if isinstance(value, str) else None


def _aliased(message: dict[str, Any]) -> dict[str, Any]:
    """A message's reasoning under every name templates read it by (as transformers passes it)."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


class LightTokenizer:
    def __init__(self, tokenizer: Tokenizer, config: dict[str, Any], chat_template: str | None, path: Path) -> None:
        self._tokenizer = tokenizer
        self._path = path
        self._full = None
        self.chat_template = chat_template
        self.special_tokens_map = {
            name: text for name in SPECIAL_NAMES if (text := _token_text(config.get(name))) is not None
        }
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        self._extra_special = [t for t in map(_token_text, extra if isinstance(extra, list) else extra.values()) if t]
        self.name_or_path = str(path)

    # ---- special tokens ------------------------------------------------------------------
    def _special(self, name: str) -> str | None:
        return self.special_tokens_map.get(name)

    def _special_id(self, name: str) -> int | None:
        text = self.special_tokens_map.get(name)
        return None if text is None else self._tokenizer.token_to_id(text)

    bos_token = property(lambda self: self._special("bos_token"))
    eos_token = property(lambda self: self._special("eos_token"))
    pad_token = property(lambda self: self._special("pad_token"))
    unk_token = property(lambda self: self._special("unk_token"))
    bos_token_id = property(lambda self: self._special_id("bos_token"))
    eos_token_id = property(lambda self: self._special_id("eos_token"))
    pad_token_id = property(lambda self: self._special_id("pad_token"))
    unk_token_id = property(lambda self: self._special_id("unk_token"))

    @property
    def all_special_tokens(self) -> list[str]:
        out: list[str] = []
        for text in [*self.special_tokens_map.values(), *self._extra_special]:
            if text not in out:
                out.append(text)
        return out

    @property
    def all_special_ids(self) -> list[int]:
        return [i for i in map(self._tokenizer.token_to_id, self.all_special_tokens) if i is not None]

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return self._tokenizer.get_added_tokens_decoder()

    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    # ---- text <-> ids --------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False,
               **kwargs: Any) -> list[int]:
        if kwargs:
            return self.transformers_tokenizer.encode(text, add_special_tokens=add_special_tokens,
                                                      split_special_tokens=split_special_tokens, **kwargs)
        if self._tokenizer.encode_special_tokens != split_special_tokens:
            self._tokenizer.encode_special_tokens = split_special_tokens
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False, **kwargs: Any) -> str:
        if kwargs:
            return self.transformers_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> str | list[str] | None:
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else ()
        return [self._tokenizer.id_to_token(i) for i in ids if i not in special]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._tokenizer.token_to_id(tokens)
        return [self._tokenizer.token_to_id(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    # ---- chat template -------------------------------------------------------------------
    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: list[dict] | None = None,
                            documents: list[dict] | None = None, add_generation_prompt: bool = False,
                            tokenize: bool = True, chat_template: str | None = None, **kwargs: Any):
        template = chat_template if chat_template is not None else self.chat_template
        plain = (isinstance(template, str) and not _GENERATION_TAG.search(template) and isinstance(conversation, list)
                 and all(isinstance(m, dict) for m in conversation) and conversation
                 and all(isinstance(t, dict) for t in tools or ()) and not (set(kwargs) & _DELEGATED_KWARGS))
        if not plain:
            return self.transformers_tokenizer.apply_chat_template(
                conversation, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
                tokenize=tokenize, chat_template=chat_template, **kwargs)
        from nanovllm.loaders.chat_template import render_chat_template

        messages = [_aliased({k: v for k, v in m.items() if v is not None}) for m in conversation]
        text = render_chat_template(template, messages=messages, tools=tools, documents=documents,
                                    add_generation_prompt=add_generation_prompt,
                                    **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # ---- everything else -----------------------------------------------------------------
    @property
    def transformers_tokenizer(self):
        """The transformers tokenizer of the same directory (imports transformers on first use)."""
        if self._full is None:
            import transformers

            config = json.loads((self._path / "tokenizer_config.json").read_text(encoding="utf-8"))
            cls = getattr(transformers, config.get("tokenizer_class") or "PreTrainedTokenizerFast")
            self._full = cls.from_pretrained(str(self._path), local_files_only=True)
        return self._full

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not delegated: copy and pickle probe these before __init__ ran
            raise AttributeError(name)
        return getattr(self.transformers_tokenizer, name)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_full": None}

    def __repr__(self) -> str:
        return f"LightTokenizer({self.name_or_path!r}, vocab={len(self)})"


# apply_chat_template options whose handling is transformers' own (kept there).
_DELEGATED_KWARGS = frozenset({
    "continue_final_message", "return_assistant_tokens_mask", "return_dict", "return_tensors", "padding",
    "truncation", "max_length", "tokenizer_kwargs", "sanitize_control_tokens",
})
