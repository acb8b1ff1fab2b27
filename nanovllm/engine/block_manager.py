"""The paged KV cache's bookkeeping: a pool of fixed-size blocks with ref counts and a
prefix cache. Pure Python; the tensors live in the model runner.

Prefix caching: a block that is full and whose K/V are computed gets a key, the chained hash
`h_i = xxh3_64(tokens of block i, seed=h_{i-1})`, so equal keys mean equal whole prefixes. A hit
is verified against the stored parent key and token ids, so a hash collision can never serve
wrong K/V. Freed blocks keep their key and stay reusable (ref count 0, in the free queue) until
an allocation needs their memory; the free queue is LRU, and a sequence's blocks are freed
tail-first so the ends of prefixes are evicted before their starts.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict

import xxhash

from nanovllm.engine.sequence import PLACEHOLDER_TOKEN, Sequence

ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids) -> int:
    return xxhash.xxh3_64_intdigest(array("q", token_ids).tobytes(), seed=parent_hash)


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "parent_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.parent_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_queries = 0  # prompt blocks looked up in the prefix cache
        self.prefix_hits = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        """Extend seq.block_hashes to cover its first `num_full_blocks` blocks."""
        hashes, bs, tokens = seq.block_hashes, self.block_size, seq.token_ids
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[i - 1] if i else ROOT_HASH
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of `seq` (no references taken).
        At least one token is always left to compute, so the step yields logits."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(seq, max_blocks)
        bs, hits = self.block_size, []
        for i in range(max_blocks):
            block_id = self.cached.get(hashes[i])
            if block_id is None:
                break
            block = self.blocks[block_id]
            parent = hashes[i - 1] if i else ROOT_HASH
            if block.parent_hash != parent or block.token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break
            hits.append(block_id)
        self.prefix_queries += max_blocks
        self.prefix_hits += len(hits)
        return hits

    # ---- allocation ----------------------------------------------------------------------
    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its prefix-cache entry
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash = block.parent_hash = block.token_ids = None
        block.ref_count = 1
        return block_id

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        """Make seq's block table cover its computed tokens (plus `cached_blocks`, a prefix hit
        for a sequence with no blocks yet) plus `num_new_tokens`. All or nothing."""
        if not cached_blocks:  # every running sequence, every step: mostly no new block
            if self.blocks_needed(seq.num_computed_tokens + num_new_tokens) <= len(seq.block_table):
                return True
        cached_blocks = cached_blocks or []
        if cached_blocks and seq.block_table:
            raise RuntimeError("a prefix hit can only be applied to a sequence without blocks")
        num_computed = len(cached_blocks) * self.block_size if cached_blocks else seq.num_computed_tokens
        needed = self.blocks_needed(num_computed + num_new_tokens) - len(seq.block_table) - len(cached_blocks)
        # Hit blocks sitting in the free queue are about to be taken, so they cannot also be new blocks.
        reusable = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if needed > self.num_free_blocks - reusable:
            return False
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        if cached_blocks:
            seq.num_computed_tokens = num_computed
            if not seq.num_preemptions:  # the prompt's hit at its first admission (vLLM's), not a readmission's
                seq.num_cached_tokens = num_computed
            seq.num_registered_blocks = len(cached_blocks)
        for _ in range(max(needed, 0)):
            seq.block_table.append(self._take_free_block())
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every block of seq that is full and computed (prompt or decode alike)."""
        if not self.enable_prefix_caching:
            return
        known = seq.num_computed_tokens  # a burst in flight has computed tokens not yet on the host
        while known and seq.token_ids[known - 1] == PLACEHOLDER_TOKEN:
            known -= 1
        num_full = min(known // self.block_size, len(seq.block_table))
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self._block_hashes(seq, num_full)
        bs = self.block_size
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:
                continue
            if hashes[i] in self.cached:  # same content already cached in another block
                continue
            block.hash = hashes[i]
            block.parent_hash = hashes[i - 1] if i else ROOT_HASH
            block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            self.cached[block.hash] = block.block_id
        seq.num_registered_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Drop seq's references, tail first; blocks reaching zero join the free queue."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block_id} (seq {seq.seq_id})")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        seq.block_table = []
        seq.num_registered_blocks = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (benchmarks start cold). Only when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.hash = block.parent_hash = block.token_ids = None
        self.cached.clear()
        return True

    def check_invariants(self, live: list[Sequence]) -> None:
        """Raise if ref counts disagree with the block tables of `live` sequences (tests, debug)."""
        counts = [0] * self.num_blocks
        for seq in live:
            for block_id in seq.block_table:
                counts[block_id] += 1
        for block in self.blocks:
            if block.ref_count != counts[block.block_id]:
                raise RuntimeError(f"block {block.block_id}: ref_count {block.ref_count} != {counts[block.block_id]}")
            if (block.ref_count == 0) != (block.block_id in self.free_queue):
                raise RuntimeError(f"block {block.block_id}: free-queue membership disagrees with ref count")
        for h, block_id in self.cached.items():
            if self.blocks[block_id].hash != h:
                raise RuntimeError(f"cache entry {h:x} points at block {block_id} with another hash")
