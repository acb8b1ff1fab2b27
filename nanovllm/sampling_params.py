"""Per-request sampling controls, validated at construction.

Mirrors vLLM's `SamplingParams` for the fields we support. Every invalid value raises
`ValueError` naming the field, so bad input never reaches the engine loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Temperatures below this are sampled greedily (as in vLLM); logits / 1e-6 can overflow fp32.
GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 64
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    # Not user-facing in vLLM's constructor order but handy: skip special tokens when detokenizing.
    skip_special_tokens: bool = True
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}: {why} (got {getattr(self, name)!r})")

        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0 (0 means greedy)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", "must be -1 (off) or an integer >= 1")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", "must be an integer or None")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise bad("min_tokens", "must be an integer in [0, max_tokens]")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0 or self.logprobs > 20):
            raise bad("logprobs", "must be None or an integer in [0, 20]")
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
        self.stop_list = stops
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")
        else:
            self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        """Whether this request samples greedily (argmax): temperature below GREEDY_EPS."""
        return self.temperature < GREEDY_EPS

    @property
    def plain_temperature(self) -> bool:
        """Whether this request samples at its temperature with nothing else: no top-k, top-p or
        min-p filter and no seed of its own (a seeded request draws from its own generator). Such
        a row is one Gumbel-max draw over logits / temperature (layers/fused_sampler.py), which
        the persistent decode kernel can take too (a lone stream's decode bursts)."""
        return not self.greedy and self.top_k == -1 and self.top_p == 1.0 and self.min_p == 0.0 and self.seed is None
