"""Per-request sampling controls, validated at construction.

Mirrors vLLM's `SamplingParams` for the fields we support. Every invalid value raises
`ValueError` naming the field, so bad input never reaches the engine loop: numbers must be
finite and in range, a `bool` is never taken for a number (`logprobs=True` is refused), and
flags must be real bools. The object is frozen once validated, so a value cannot be changed
behind the validation's back (use `dataclasses.replace(params, n=2)`, which validates again).
"""
from __future__ import annotations

import functools
import json as _json
import math
from dataclasses import dataclass, field

# Temperatures below this are sampled greedily (as in vLLM); logits / 1e-6 can overflow fp32.
GREEDY_EPS = 1e-5
# Above this, sampling is uniform to within float precision; larger values are a client bug.
MAX_TEMPERATURE = 100.0
# Seeds (plus the sample index) must fit torch.Generator.manual_seed's unsigned 64 bits.
MAX_SEED = 2**63 - 1
# vLLM's (and OpenAI's) ranges: presence and frequency penalties in [-2, 2], logit biases in
# [-100, 100] (a bias of +-100 is a ban or an exclusive choice; larger values only overflow).
MAX_ADDITIVE_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
# A JSON schema (structured_outputs.json, response_format's, a tool's parameters) nests objects and
# arrays at most this deep, and its JSON text is at most this long: real schemas stay far below
# both, and they bound the time its checks and its grammar take to build (the build's time grows
# fast with depth).
MAX_SCHEMA_DEPTH = 64
MAX_SCHEMA_CHARS = 256 * 1024


def is_int(x: object) -> bool:
    """An int that is not a bool (bool is an int to Python); EngineConfig's checks use it too."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: object) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def nests_deeper(value: object, depth: int) -> bool:
    """Whether `value` nests dicts and lists (tuples) more than `depth` deep; without recursion."""
    todo = [(value, 1)]
    while todo:
        item, level = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, (list, tuple)) else None
        if children is None:
            continue
        if level > depth:
            return True
        todo += [(child, level + 1) for child in children]
    return False


def schema_text(schema: object, what: str) -> str:
    """`schema` as compact JSON text, key order kept (a schema's property order is the order the
    output writes them in); ValueError naming `what` where it is not JSON-serializable, nests
    deeper than MAX_SCHEMA_DEPTH or is longer than MAX_SCHEMA_CHARS."""
    if nests_deeper(schema, MAX_SCHEMA_DEPTH):
        raise ValueError(f"{what}: is nested too deeply (more than {MAX_SCHEMA_DEPTH} levels of objects and arrays)")
    try:
        text = _json.dumps(schema, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what}: is not JSON-serializable ({e})") from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"{what}: is too long ({len(text)} characters as JSON text, at most {MAX_SCHEMA_CHARS})")
    return text


@functools.lru_cache(maxsize=1024)
def metaschema_problem(text: str) -> str | None:
    """Why the JSON schema `text` (schema_text's) is not a valid schema (jsonschema's check against
    the 2020-12 metaschema), with where in it as a JSON pointer, or None. Cached by the text: a
    check costs milliseconds, and agents send the same tools and schemas with every turn."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(_json.loads(text))
    except SchemaError as exc:
        where = "".join("/" + str(part).replace("~", "~0").replace("/", "~1") for part in exc.absolute_path)
        return f"#{where}: {exc.message}"
    return None


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's names): exactly one field is set.

    - json: a JSON schema, as a dict or as JSON text.
    - regex: a regular expression the whole output matches.
    - choice: the output is exactly one of these strings.
    - grammar: a context-free grammar in GBNF (llama.cpp's EBNF dialect).
    - json_object: True for any JSON object.

    Only the form is checked here; whether the grammar engine supports the schema, regex or
    grammar is checked when the engine compiles it (nanovllm/structured/), also a ValueError
    naming the field.
    """
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # The field that is set (one of STRUCTURED_KINDS), and the constraint as canonical text: with
    # `kind`, the key of the grammar compile cache. Worked out once, here (a server admits every
    # constrained request through them).
    kind: str = field(init=False, repr=False, compare=False)
    spec: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            got = repr(getattr(self, name))
            if len(got) > 200:  # a schema can be megabytes long
                got = got[:200] + "..."
            return ValueError(f"StructuredOutputsParams.{name}: {why} (got {got})")

        set_fields = [name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError("StructuredOutputsParams: exactly one of json, regex, choice, grammar, "
                             f"json_object must be set (got {set_fields or 'none'})")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = _json.loads(self.json)
                except ValueError as e:
                    raise bad("json", f"is not valid JSON text ({e})") from None
                except RecursionError:
                    raise bad("json", f"is nested too deeply (more than {MAX_SCHEMA_DEPTH} levels of objects and "
                                      "arrays)") from None
            else:
                schema = self.json
            if not isinstance(schema, dict):
                raise bad("json", "must be a JSON schema: a dict or the JSON text of an object")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise bad(name, "must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise bad("choice", "must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise bad("json_object", "must be a bool")
        kind = set_fields[0]
        if kind == "json":
            spec = schema_text(schema, "StructuredOutputsParams.json")
        elif kind == "choice":
            spec = _json.dumps(self.choice)
        elif kind == "json_object":
            spec = ""
        else:
            spec = getattr(self, kind)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "spec", spec)

    def __hash__(self) -> int:
        return hash((self.kind, self.spec))


# The fields of StructuredOutputsParams, in order; exactly one is set.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def truncate_prompt(ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """The prompt ids a request with `truncate_prompt_tokens` k (a valid value: SamplingParams
    checks it) runs on, as vLLM's: the last k; k = -1: the last max_model_len - 1, the longest
    prompt that leaves room for a generated token; None: all of them. ValueError naming the
    field where k is over max_model_len, as vLLM refuses a truncation longer than the context."""
    if k is None:
        return ids
    if k == -1:
        k = max_model_len - 1
    elif k > max_model_len:
        raise ValueError(f"truncate_prompt_tokens: {k} is more than max_model_len ({max_model_len}); "
                         "give a smaller one, or -1 (as many as the context allows)")
    return list(ids[-k:]) if len(ids) > k else ids


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 64  # None: as many as the context leaves (max_model_len less the prompt), as vLLM
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # vLLM's: the logprob of each prompt token after the first (under the tokens before it) and
    # the k most likely tokens at its position (RequestOutput.prompt_logprobs); None: off.
    prompt_logprobs: int | None = None
    n: int = 1
    # Not user-facing in vLLM's constructor order but handy: skip special tokens when detokenizing.
    skip_special_tokens: bool = True
    # vLLM's definitions, applied on the raw logits (layers/penalties.py): presence and
    # frequency count the output only, repetition the prompt and the output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI semantics: token id -> bias in [-100, 100], added to that token's logit first.
    logit_bias: dict[int, float] | None = None
    # A grammar the output must follow (JSON schema, regex, choice, GBNF grammar, any JSON object).
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: the stop string that ends the output stays in its text (and so does the text of a
    # stop token that ends it: EOS or a stop_token_ids entry).
    include_stop_str_in_output: bool = False
    # vLLM's: the request runs on the last k tokens of its prompt (left truncation); -1: on as
    # many as max_model_len leaves room for (truncate_prompt); None: the whole prompt.
    truncate_prompt_tokens: int | None = None
    # vLLM's: only these token ids may be sampled (a non-empty list; ids outside the vocabulary
    # are refused when the request is added).
    allowed_token_ids: list[int] | None = None
    # vLLM's: words that may not be generated. The engine tokenizes each (LLMEngine.add_request:
    # as written and after a space), and at every step bans the last token of a word whose other
    # tokens end the output so far (Sequence.bad_word_bans).
    bad_words: list[str] | None = None
    # bad_words as the token sequences they ban (nanovllm/bad_words.py), where they were
    # tokenized already: the server's front end sets it so that the engine core need not.
    # None: the engine tokenizes bad_words itself.
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    stop_list: list[str] = field(init=False, repr=False)
    # Sampled (not greedy) with a top-k / top-p / min-p filter or a seed of its own: on CUDA such
    # a row takes layers/filtered_sampler.py (Sampler.wants_step_seeds reads it every step).
    filters_or_seed: bool = field(init=False, repr=False, compare=False)
    # A presence, frequency or repetition penalty is on: the runner then keeps this sequence's
    # token counts on the device (runner/penalty_state.py).
    penalized: bool = field(init=False, repr=False, compare=False)
    # This request's token is the argmax of its logits and nothing else is read from them or
    # kept from it: greedy, no logprobs, no penalty counts. A grammar may then check the token
    # after sampling, and a refused one is the masked argmax (engine/grammars.py). (Both are
    # read for every row of every step, so they are worked out once, here.)
    takes_argmax: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}: {why} (got {getattr(self, name)!r})")

        if not is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad("temperature", f"must be a finite number in [0, {MAX_TEMPERATURE:g}] (0 means greedy)")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be 0 or -1 (off) or an integer >= 1")
        if self.top_k == 0:  # vLLM's "off" (as in Hugging Face configs); -1 here
            object.__setattr__(self, "top_k", -1)
        if not is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be a number in (0, 1]")
        if not is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be a number in [0, 1]")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1, or None (as many as the context leaves)")
        if not is_int(self.min_tokens) or self.min_tokens < 0 or (
                self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", "must be an integer in [0, max_tokens]")
        if not is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED - self.n):
            raise bad("seed", "must be None or an integer in [0, 2**63 - 1 - n]")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "must be None or an integer in [0, 20]")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= 20):
            raise bad("prompt_logprobs", "must be None or an integer in [0, 20]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not -MAX_ADDITIVE_PENALTY <= value <= MAX_ADDITIVE_PENALTY:
                raise bad(name, f"must be a finite number in [-{MAX_ADDITIVE_PENALTY:g}, {MAX_ADDITIVE_PENALTY:g}]")
        if not is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be a finite number > 0 (1 means off)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must be a dict of token id -> bias")
            for token, bias in self.logit_bias.items():
                if not is_int(token) or token < 0:
                    raise bad("logit_bias", f"key {token!r} is not a token id (a non-negative integer)")
                if not is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                    raise bad("logit_bias", f"bias {bias!r} of token {token} is not a number in "
                                            f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
            object.__setattr__(self, "logit_bias", {t: float(b) for t, b in self.logit_bias.items()} or None)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be None or a StructuredOutputsParams")
        if self.truncate_prompt_tokens is not None and (
                not is_int(self.truncate_prompt_tokens) or not (self.truncate_prompt_tokens >= 1
                                                                or self.truncate_prompt_tokens == -1)):
            raise bad("truncate_prompt_tokens", "must be None, an integer >= 1 or -1 (as many as the context allows)")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids or not all(
                    is_int(t) and t >= 0 for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", "must be None or a non-empty list of token ids (non-negative integers)")
            # each id once, in the order given (a step's bans are built from the list)
            object.__setattr__(self, "allowed_token_ids", list(dict.fromkeys(self.allowed_token_ids)))
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(
                    isinstance(w, str) and w.strip() for w in self.bad_words):
                raise bad("bad_words", "must be None or a list of strings that are not empty or only spaces")
            object.__setattr__(self, "bad_words", list(self.bad_words) or None)
        if self.bad_words_token_ids is not None:
            if not self.bad_words or not isinstance(self.bad_words_token_ids, (list, tuple)) or not all(
                    isinstance(ids, (list, tuple)) and ids and all(is_int(t) and t >= 0 for t in ids)
                    for ids in self.bad_words_token_ids):
                raise bad("bad_words_token_ids", "must be None, or with bad_words a list of non-empty lists of "
                          "token ids (non-negative integers)")
            object.__setattr__(self, "bad_words_token_ids", [list(ids) for ids in self.bad_words_token_ids])
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a bool")
        if self.stop is None:
            stops: list[str] = []
        elif isinstance(self.stop, str):
            stops = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            stops = list(self.stop)
        else:
            raise bad("stop", "must be a string or a list of strings")
        if any(s == "" for s in stops):
            raise bad("stop", "stop strings must not be empty")
        # Frozen: the normalized values are set once, here, through object.__setattr__.
        object.__setattr__(self, "stop_list", stops)
        penalized = self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
        object.__setattr__(self, "penalized", penalized)
        object.__setattr__(self, "takes_argmax", self.greedy and self.logprobs is None and not penalized)
        object.__setattr__(self, "filters_or_seed", not self.greedy and (
            self.top_k != -1 or self.top_p < 1.0 or self.min_p > 0.0 or self.seed is not None))
        if self.stop_token_ids is None:
            object.__setattr__(self, "stop_token_ids", [])
        elif not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")
        else:
            object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        """Whether this request samples greedily (argmax): temperature below GREEDY_EPS."""
        return self.temperature < GREEDY_EPS

    @property
    def edits_logits(self) -> bool:
        """Whether a penalty, a logit bias or a grammar's token mask changes the logits before
        sampling: such a request never takes the fused temperature kernels; a lone stream of one
        without a grammar takes the fast path's filtered graphs and decode bursts."""
        return self.penalized or self.logit_bias is not None or self.structured_outputs is not None

    @property
    def restricts_tokens(self) -> bool:
        """Whether allowed_token_ids or bad_words keep tokens from being sampled. The runner's
        sampler masks them at every step (layers/penalties.TokenBans), so such a request takes
        no path that samples without it: no decode bursts, neither the fast path's graphs nor
        the runner's greedy shortcut (Sampler.greedy)."""
        return self.allowed_token_ids is not None or self.bad_words is not None

    @property
    def plain_temperature(self) -> bool:
        """Whether this request samples at its temperature with nothing else: no top-k, top-p or
        min-p filter and no penalty or logit bias (a seed is allowed: on CUDA it keys the noise,
        layers/sampler.step_seed). Such a row is one Gumbel-max draw over logits / temperature
        (layers/fused_sampler.py), which the persistent decode kernel can take too (a lone
        stream's decode bursts)."""
        return (not self.greedy and self.top_k == -1 and self.top_p == 1.0 and self.min_p == 0.0
                and not self.edits_logits)
