"""Grammar compilation off the engine loop: a thread pool and a cache keyed by (kind, spec).

Compiling turns a Grammar into xgrammar's CompiledGrammar: the grammar plus, for this
tokenizer, which tokens each grammar position accepts (the tables that make a per-token mask
cheap). It takes milliseconds to a few hundred for large schemas, so it runs in worker threads
(xgrammar releases the GIL) while the engine keeps stepping; the request that asked waits for
its future. The tokenizer's tables (TokenizerInfo: every token's bytes) are built once, on the
first constrained request, in the same pool, so an engine that never sees one never pays it.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from nanovllm.sampling_params import StructuredOutputsParams
from nanovllm.structured.grammar import build_grammar

# Compiled grammars kept, least recently used dropped first: at most CACHE_SIZE of them and
# CACHE_BYTES of xgrammar's tables together (CompiledGrammar.memory_size_bytes). A JSON schema's
# tables are tens of KB to a few MB, but an enum of tens of thousands of values (within the
# schema's size limit) takes tens of MB.
CACHE_SIZE = 256
CACHE_BYTES = 512 * 2**20
# Builds and compiles that run at once. Each is C++ that releases the GIL, so a slow one (a
# pattern's long repeat takes seconds) shares the cores with the others instead of holding
# them up in a queue.
POOL_WORKERS = 16


class GrammarCompiler:
    """`submit(spec)` -> Future[CompiledGrammar]: checks the spec at once (ValueError naming
    the field) and compiles in the pool, once per distinct (kind, spec text)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], threads: int | None = None,
                 cache_bytes: int = CACHE_BYTES) -> None:
        if tokenizer is None:
            raise ValueError("structured_outputs: this model has no tokenizer to build grammars over")
        if threads is None:  # xgrammar compiles one grammar on several threads; the engine loop keeps a core
            threads = max(1, min(8, (os.cpu_count() or 2) // 2))
        self._pool = ThreadPoolExecutor(max_workers=POOL_WORKERS, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}  # the cached grammars compiled so far: their bytes
        self._bytes = 0  # the sum of _sizes
        self._cache_bytes = cache_bytes
        self._compiler: Future = self._pool.submit(self._make_compiler, tokenizer, vocab_size, stop_token_ids, threads)

    @staticmethod
    def _make_compiler(tokenizer, vocab_size: int, stop_token_ids: list[int], threads: int) -> xgr.GrammarCompiler:
        # xgrammar reads a transformers tokenizer (loaders/light_tokenizer.py hands out its own).
        tokenizer = getattr(tokenizer, "transformers_tokenizer", tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        return xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)

    def wait_ready(self) -> None:
        """Block until the tokenizer's tables are built (the first compile waits for them anyway)."""
        self._compiler.result()

    def submit(self, spec: StructuredOutputsParams, check_in_pool: bool = False) -> Future:
        """check_in_pool: the spec's grammar is built in the pool too (it can take seconds for
        some schemas, e.g. long repeats in a pattern): a bad spec's ValueError then comes from
        the future, and is cached with it. Else it is built here, and a ValueError raised here
        leaves nothing cached."""
        key = (spec.kind, spec.spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
        grammar = None if check_in_pool else build_grammar(spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                return future
            if grammar is None:
                future = self._pool.submit(lambda: self._compile(build_grammar(spec)))
            else:
                future = self._pool.submit(self._compile, grammar)
            self._cache[key] = future
            self._evict()
        future.add_done_callback(lambda done: self._compiled(key, done))  # outside the lock: it may run here
        return future

    def _compiled(self, key: tuple[str, str], future: Future) -> None:
        """A compile finished: its grammar's bytes count towards the cache's while it is cached."""
        if future.cancelled() or future.exception() is not None:
            return
        with self._lock:
            if self._cache.get(key) is future:
                self._sizes[key] = future.result().memory_size_bytes
                self._bytes += self._sizes[key]
                self._evict()

    def _evict(self) -> None:
        """Drop the least recently used grammars while the cache holds more than CACHE_SIZE or
        more bytes than its budget (the newest stays: a request is waiting for it). Requests
        and matchers still using a dropped grammar keep it."""
        while len(self._cache) > 1 and (len(self._cache) > CACHE_SIZE or self._bytes > self._cache_bytes):
            key, _ = self._cache.popitem(last=False)
            self._bytes -= self._sizes.pop(key, 0)

    @property
    def cached_bytes(self) -> int:
        """The bytes of xgrammar's tables of the cached grammars compiled so far."""
        with self._lock:
            return self._bytes

    def _compile(self, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        return self._compiler.result().compile_grammar(grammar)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
