"""Scheduler: the token-budget rule, chunked prefill, preemption, and a property-based
simulation of whole workloads against a fake KV cache that checks every cached slot holds
the K/V of exactly the right prefix."""
from __future__ import annotations

import random

import pytest

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.step import burst_sizes
from nanovllm.engine.sequence import PLACEHOLDER_TOKEN, Sequence
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams


class FakeEngine:
    """Drives a Scheduler like LLMEngine does, with a fake model: the 'K/V' written for token
    position p of a sequence is the tuple of its tokens [0..p], and the sampled token is a
    deterministic function of that prefix, so any wrong cache reuse changes the output."""

    def __init__(self, num_blocks, block_size, max_num_seqs, budget, prefix_caching=True, async_mode=False, decode_burst=1,
                 stop_every=0, refuse_every=0):
        self.async_mode = async_mode
        self.decode_burst = decode_burst
        self.bursts = 0
        self.stop_every = stop_every  # a sampled token t with t % stop_every == 0 stops its sequence
        # Async, one-step rows: a right token t with t % refuse_every == 1 comes out as t + 1000,
        # a token "the grammar refuses", unless the sequence samples "under its mask" (`masked`,
        # after a refusal). The host finds it only once the next step is launched and rolls the
        # sequence back, as LLMEngine._check does.
        self.refuse_every = refuse_every
        self.masked: set[int] = set()
        self.rollbacks = 0
        self.in_flight = None  # async: (output, sampled, void seq ids) of the launched step not yet resolved
        self.device_prev: dict[int, int] = {}  # async: the last step's sampled ids, "on the device"
        self.sampled_at: dict[int, dict[int, int]] = {}  # every id sampled, by sequence and index
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.sched = Scheduler(self.bm, max_num_seqs, budget)
        self.kv: dict[int, tuple] = {}
        self.seqs: dict[int, Sequence] = {}
        self.max_tokens: dict[int, int] = {}
        self.next_id = 0
        self.steps = 0

    def add(self, prompt, max_tokens):
        seq = Sequence(self.next_id, str(self.next_id), list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens), max_tokens=max_tokens)
        self.next_id += 1
        self.seqs[seq.seq_id] = seq
        self.max_tokens[seq.seq_id] = max_tokens
        self.sched.add(seq)
        return seq

    def slot(self, seq_table, pos):
        return seq_table[pos // self.bm.block_size] * self.bm.block_size + pos % self.bm.block_size

    def step(self):
        out = self.sched.schedule(self.decode_burst)
        self.steps += 1
        assert out.num_batched_tokens <= self.sched.max_num_batched_tokens
        assert len(self.sched.running) <= self.sched.max_num_seqs
        assert all(len(s.token_ids) == 1 for s in out.seqs[: out.num_decodes])
        assert all(s.token_ids for s in out.seqs)  # a step computes at least one token of each
        decode_contexts = [s.start_pos for s in out.seqs[: out.num_decodes]]
        assert decode_contexts == sorted(decode_contexts, reverse=True)  # longest context first
        sampled, device_now = [], {}
        for item in out.seqs:
            seq = self.seqs[item.seq_id]
            # the "device" substitutes the previous step's sampled id for a placeholder input
            new = [self.device_prev[item.seq_id] if t == PLACEHOLDER_TOKEN else t for t in item.token_ids]
            # tokens before start_pos may still be on their way to the host (a burst's, async);
            # the K/V check reads what the device sampled there
            sampled_at = self.sampled_at.setdefault(item.seq_id, {})
            history = seq.token_ids[: item.start_pos]
            assert all(sampled_at.get(i) is not None for i, t in enumerate(history) if t == PLACEHOLDER_TOKEN)
            full = [sampled_at[i] if t == PLACEHOLDER_TOKEN else t for i, t in enumerate(history)] + new
            # every cached position this step attends to holds the right prefix
            for pos in range(item.start_pos):
                assert self.kv[self.slot(item.block_table, pos)] == tuple(full[: pos + 1])
            for j in range(len(new)):
                pos = item.start_pos + j
                self.kv[self.slot(item.block_table, pos)] = tuple(full[: pos + 1])
            if item.num_steps > 1:  # a burst: only for a greedy decode alone, nothing waiting
                assert len(out.seqs) == 1 and len(new) == 1 and not self.sched.waiting
                self.bursts += 1
            token = None
            for j in range(item.num_steps if item.sample else 0):
                if j:  # the burst's next step: the token just sampled goes in
                    full.append(token)
                    pos = item.start_pos + j
                    self.kv[self.slot(item.block_table, pos)] = tuple(full[: pos + 1])
                token = hash(tuple(full)) % 1000
                if item.num_steps == 1 and self.refuse_every and item.seq_id not in self.masked \
                        and token % self.refuse_every == 1:
                    token += 1000
                self.masked.discard(item.seq_id)
                sampled_at[len(full)] = token
                sampled.append(token)
                device_now[item.seq_id] = token
        self.device_prev = device_now
        self.sched.advance(out, self.seqs)
        if self.async_mode:
            previous, self.in_flight = self.in_flight, (out, sampled, set())
            if previous is not None:
                rolled_back = self._check(*previous)
                self.in_flight[2].update(item.seq_id for item in out.seqs if item.sample and item.seq_id in rolled_back)
                self._resolve(previous[0], previous[1], previous[2] | rolled_back)
            if out.is_empty:
                self._resolve(*self.in_flight)
                self.in_flight = None
        else:
            self._resolve(out, sampled)
        live = [s for s in self.seqs.values() if s.block_table]
        self.bm.check_invariants(live)
        return out

    def _check(self, out, sampled, void):
        """Roll back the live sequences whose token of this step came out refused."""
        rolled_back = set()
        tokens = iter(sampled)
        for item in out.seqs:
            row = [next(tokens) for _ in range(item.num_steps)] if item.sample else []
            seq = self.seqs[item.seq_id]
            if row and row[0] >= 1000 and item.seq_id not in void and not seq.is_finished:
                self.sched.roll_back(seq, item.start_pos + len(item.token_ids))
                self.masked.add(seq.seq_id)
                rolled_back.add(seq.seq_id)
                self.rollbacks += 1
        return rolled_back

    def _resolve(self, out, sampled, void=frozenset()):
        for seq, index in self.sched.resolve(out, self.seqs, sampled, void):
            if seq.is_finished:
                continue  # a burst's tokens after its stop, as LLMEngine._process skips them
            if self.stop_every and seq.token_ids[index] % self.stop_every == 0:
                self.sched.finish(seq, "stop", num_tokens=index + 1)
            elif index + 1 - seq.num_prompt_tokens >= self.max_tokens[seq.seq_id]:
                self.sched.finish(seq, "length", num_tokens=index + 1)

    def has_unfinished(self):
        return self.sched.has_unfinished() or self.in_flight is not None

    def run(self, max_steps=10_000):
        while self.has_unfinished():
            self.step()
            assert self.steps < max_steps, "scheduler made no progress"


def reference_tokens(prompt, max_tokens, stop_every=0):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(hash(tuple(tokens)) % 1000)
        if stop_every and tokens[-1] % stop_every == 0:
            break
    return tokens[len(prompt):]


def test_decodes_first_and_prefill_is_chunked_by_budget():
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=8, budget=8)
    a = eng.add(range(3), max_tokens=5)
    eng.step()  # a prefilled (3 tokens), sampled
    eng.add(range(100, 120), max_tokens=2)  # 20-token prompt, budget 8 -> chunks
    out = eng.step()
    assert out.num_decodes == 1 and out.seqs[0].seq_id == a.seq_id
    assert [len(s.token_ids) for s in out.seqs] == [1, 7]
    assert out.seqs[1].sample is False
    eng.run()
    assert all(s.finish_reason == "length" for s in eng.seqs.values())


def test_decodes_are_listed_longest_context_first():
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=8, budget=64)
    short, long_, mid = eng.add(range(2), max_tokens=9), eng.add(range(30), max_tokens=9), eng.add(range(9), max_tokens=9)
    eng.step()  # all three prefilled in arrival order
    out = eng.step()
    assert out.num_decodes == 3
    assert [s.seq_id for s in out.seqs] == [long_.seq_id, mid.seq_id, short.seq_id]
    eng.run()
    for seq, n in ((short, 2), (long_, 30), (mid, 9)):
        assert seq.completion_token_ids == reference_tokens(list(range(n)), 9)


def test_preemption_recomputes_and_gives_same_tokens():
    prompts = [list(range(i * 10, i * 10 + 7)) for i in range(4)]
    eng = FakeEngine(num_blocks=9, block_size=4, max_num_seqs=4, budget=64)
    seqs = [eng.add(p, max_tokens=10) for p in prompts]
    eng.run()
    assert eng.sched.num_preemptions > 0
    for p, s in zip(prompts, seqs):
        assert s.completion_token_ids == reference_tokens(p, 10)
    assert eng.bm.num_free_blocks == eng.bm.num_blocks


def test_most_recently_admitted_is_preempted():
    eng = FakeEngine(num_blocks=4, block_size=4, max_num_seqs=4, budget=64)
    a = eng.add(range(7), max_tokens=8)
    b = eng.add(range(50, 57), max_tokens=8)
    eng.step()  # both admitted: 2 blocks each, pool full
    eng.step()  # both decode at position 7, still in block 2
    eng.step()  # position 8 needs a third block: b (admitted last) is preempted
    assert b.num_preemptions == 1 and a.num_preemptions == 0


def test_sequence_that_outgrows_the_whole_pool_finishes_with_length():
    eng = FakeEngine(num_blocks=2, block_size=4, max_num_seqs=2, budget=64)
    s = eng.add(range(5), max_tokens=100)
    eng.run()
    # 8 slots hold 8 computed tokens; the token sampled from the last of them is kept
    assert s.finish_reason == "length" and s.num_tokens == 9
    assert eng.bm.num_free_blocks == 2


def test_max_num_seqs_limits_running():
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=2, budget=1000)
    for i in range(5):
        eng.add(range(i, i + 5), max_tokens=3)
    out = eng.step()
    assert len(out.seqs) == 2
    eng.run()


def test_prefix_hit_skips_cached_tokens():
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=8, budget=1000)
    eng.add(range(13), max_tokens=1)
    eng.run()
    s = eng.add(list(range(12)) + [77, 78], max_tokens=1)
    out = eng.step()
    assert out.seqs[0].start_pos == 12 and s.num_cached_tokens == 12


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_blocks=st.integers(4, 40),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 40),
    prefix_caching=st.booleans(),
    async_mode=st.booleans(),
    decode_burst=st.sampled_from([1, 1, 2, 3, 8]),
    stop_every=st.sampled_from([0, 0, 7]),
    refuse_every=st.sampled_from([0, 0, 3]),
)
def test_random_workloads_never_leak_or_corrupt(data, block_size, num_blocks, max_num_seqs, budget, prefix_caching, async_mode,
                                                decode_burst, stop_every, refuse_every):
    eng = FakeEngine(num_blocks, block_size, max_num_seqs, budget, prefix_caching, async_mode, decode_burst, stop_every,
                     refuse_every if async_mode else 0)
    rng = random.Random(data.draw(st.integers(0, 2**31)))
    shared = [rng.randrange(50) for _ in range(12)]
    capacity = num_blocks * block_size
    expected = {}
    arrivals = data.draw(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 14), st.integers(1, 8)), min_size=1, max_size=12))
    pending = list(arrivals)
    while pending or eng.has_unfinished():
        if pending and (not eng.has_unfinished() or rng.random() < 0.5):
            shared_len, own_len, max_tokens = pending.pop(0)
            prompt = shared[:shared_len] + [rng.randrange(50) for _ in range(own_len)]
            if len(prompt) + 1 > capacity:
                continue
            s = eng.add(prompt, max_tokens)
            expected[s.seq_id] = (prompt, max_tokens)
        if rng.random() < 0.1 and eng.sched.running:  # abort one now and then
            victim = rng.choice(eng.sched.running)
            eng.sched.finish(victim, "abort")
            expected.pop(victim.seq_id)
        if eng.has_unfinished():
            eng.step()
        assert eng.steps < 5000
    assert eng.bm.num_free_blocks == eng.bm.num_blocks
    assert all(b.ref_count == 0 for b in eng.bm.blocks)
    for seq_id, (prompt, max_tokens) in expected.items():
        seq = eng.seqs[seq_id]
        ref = reference_tokens(prompt, max_tokens, stop_every)
        if seq.finish_reason == "length" and seq.num_completion_tokens < max_tokens:
            assert seq.num_tokens > capacity - block_size  # stopped only because the pool is full
            ref = ref[: seq.num_completion_tokens]
        assert seq.completion_token_ids == ref


def test_async_mode_gives_the_same_tokens_with_preemption():
    prompts = [list(range(i * 10, i * 10 + 7)) for i in range(4)]
    eng = FakeEngine(num_blocks=9, block_size=4, max_num_seqs=4, budget=64, async_mode=True)
    seqs = [eng.add(p, max_tokens=10) for p in prompts]
    eng.run()
    assert eng.sched.num_preemptions > 0
    for p, s in zip(prompts, seqs):
        assert s.completion_token_ids == reference_tokens(p, 10)
        assert PLACEHOLDER_TOKEN not in s.token_ids
    assert eng.bm.num_free_blocks == eng.bm.num_blocks


@pytest.mark.parametrize("num_blocks", [9, 64])
def test_tokens_refused_after_the_next_launch_are_rolled_back_and_sampled_again(num_blocks):
    """Async: a third of the unmasked samples come out wrong and are found only after the next
    step, which read them, was launched. Rolling back (Scheduler.roll_back, that step's token
    void) must give every sequence the right tokens, with every cached position holding the
    right prefix (FakeEngine checks it each step), under preemption too, and leak nothing."""
    prompts = [list(range(i * 10, i * 10 + 7)) for i in range(4)]
    eng = FakeEngine(num_blocks=num_blocks, block_size=4, max_num_seqs=4, budget=64, async_mode=True, refuse_every=3)
    seqs = [eng.add(p, max_tokens=12) for p in prompts]
    eng.run()
    assert eng.rollbacks >= 4
    assert eng.sched.num_preemptions > 0 or num_blocks == 64
    for p, s in zip(prompts, seqs):
        assert s.completion_token_ids == reference_tokens(p, 12)
    assert eng.bm.num_free_blocks == eng.bm.num_blocks


@pytest.mark.parametrize("async_mode", [False, True])
@pytest.mark.parametrize("stop_every", [0, 5])
def test_decode_bursts_give_the_same_tokens(async_mode, stop_every):
    """A lone greedy sequence decodes in bursts of 3 steps (blocks of 4 positions, so bursts cross
    block boundaries); a second request admitted meanwhile ends the bursts until it is done.
    Tokens after a stop inside a burst are dropped; nothing leaks."""
    eng = FakeEngine(num_blocks=40, block_size=4, max_num_seqs=4, budget=64, async_mode=async_mode, decode_burst=3,
                     stop_every=stop_every)
    first = eng.add(list(range(5)), max_tokens=20)
    for _ in range(4):
        eng.step()
    second = eng.add(list(range(30, 36)), max_tokens=10)
    eng.run()
    assert eng.bursts > 0
    for seq, prompt, n in ((first, list(range(5)), 20), (second, list(range(30, 36)), 10)):
        assert seq.completion_token_ids == reference_tokens(prompt, n, stop_every)
        assert PLACEHOLDER_TOKEN not in seq.token_ids
    assert eng.bm.num_free_blocks == eng.bm.num_blocks


def test_burst_sizes_halve_down_to_two():
    assert burst_sizes(8) == [8, 4, 2]
    assert burst_sizes(12) == [12, 6, 3]
    assert burst_sizes(3) == [3]
    assert burst_sizes(2) == [2]
    assert burst_sizes(1) == [] and burst_sizes(0) == []


def test_burst_only_where_eligible():
    """Bursts need one decode alone with nothing waiting, no grammar, no logprobs and no
    min_tokens ban (any temperature, filter, seed, penalty or logit bias); otherwise the step is
    an ordinary one. Near max_tokens the burst is shorter."""
    bm = BlockManager(64, 4, True)
    sched = Scheduler(bm, 4, 64)

    def decode_after_prefill(params, max_tokens=50):
        seq = Sequence(0, "0", [1, 2, 3], params, max_tokens=max_tokens, min_tokens_banned_ids=[7] if params.min_tokens else [])
        sched.running.clear()
        sched.waiting.clear()
        bm.free(seq)
        sched.add(seq)
        out = sched.schedule(4)  # the prefill: never a burst
        assert [s.num_steps for s in out.seqs] == [1]
        sched.advance(out, {0: seq})
        sched.resolve(out, {0: seq}, [9])
        out = sched.schedule(4)
        sched.finish(seq, "abort")
        return out.seqs[0].num_steps, out.num_batched_tokens, out.num_decode_tokens

    assert decode_after_prefill(SamplingParams(temperature=0)) == (4, 4, 4)
    assert decode_after_prefill(SamplingParams(temperature=0.7)) == (4, 4, 4)
    for kw in (dict(top_k=3), dict(top_p=0.9), dict(min_p=0.1), dict(seed=5)):
        assert decode_after_prefill(SamplingParams(temperature=0.7, **kw))[0] == 4, kw
    assert decode_after_prefill(SamplingParams(temperature=0.7, logprobs=0))[0] == 1
    assert decode_after_prefill(SamplingParams(temperature=0, logprobs=1))[0] == 1
    assert decode_after_prefill(SamplingParams(temperature=0, min_tokens=5))[0] == 1
    for kw in (dict(presence_penalty=0.5), dict(frequency_penalty=0.5), dict(repetition_penalty=1.2),
               dict(logit_bias={3: 1.0})):  # the fast path's filtered graphs apply them on the device
        assert decode_after_prefill(SamplingParams(temperature=0, **kw))[0] == 4, kw
        assert decode_after_prefill(SamplingParams(temperature=0.6, top_k=20, **kw))[0] == 4, kw
    grammar = StructuredOutputsParams(regex="a+")  # its mask is the host's, step by step
    assert decode_after_prefill(SamplingParams(temperature=0, structured_outputs=grammar))[0] == 1
    # Near max_tokens, a shorter burst (burst_sizes: halves of 4 down to 2)
    assert decode_after_prefill(SamplingParams(temperature=0), max_tokens=4)[:2] == (2, 2)  # 1 sampled: room for 3
    assert decode_after_prefill(SamplingParams(temperature=0), max_tokens=2)[0] == 1
    assert decode_after_prefill(SamplingParams(temperature=0), max_tokens=5)[0] == 4


def test_a_request_of_many_sequences_does_not_starve_a_later_small_one():
    """Admission is round-robin across requests: a request of 20 samples queued first and a
    2-token request queued after it are both admitted in the first step (FIFO would admit 4 of
    the big request and leave the small one waiting for 16 more)."""
    bm = BlockManager(256, 4, True)
    sched = Scheduler(bm, 4, 1000)
    big = [Sequence(i, "big", [1, 2, 3], SamplingParams(max_tokens=50, n=20), max_tokens=50) for i in range(20)]
    small = Sequence(20, "small", [4, 5], SamplingParams(max_tokens=2), max_tokens=2)
    for seq in big + [small]:
        sched.add(seq)
    out = sched.schedule()
    admitted = [s.seq_id for s in out.seqs]
    assert len(admitted) == 4 and small.seq_id in admitted
    # the big request's own sequences keep their order
    assert [i for i in admitted if i != small.seq_id] == [0, 1, 2]


def test_waiting_order_preempted_first_then_round_robin_by_request():
    from nanovllm.engine.waiting_queue import WaitingQueue

    q = WaitingQueue()
    seqs = {name: Sequence(i, name[0], [1], SamplingParams()) for i, name in enumerate(["a1", "a2", "a3", "b1", "c1", "c2", "p1"])}
    for name in ["a1", "a2", "a3", "b1", "c1", "c2"]:
        q.append(seqs[name])
    q.appendleft(seqs["p1"])  # preempted
    q.remove(seqs["a2"])
    assert len(q) == 6
    order = []
    while q:
        head = q[0]
        seq = q.popleft()
        assert seq is head
        order.append(next(k for k, v in seqs.items() if v is seq))
    assert order == ["p1", "a1", "b1", "c1", "a3", "c2"]
    with pytest.raises(IndexError):
        q.popleft()
