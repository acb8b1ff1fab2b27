"""BlockManager: allocation, ref counts, prefix cache keyed by chained block hashes."""
import subprocess
import sys

import pytest

from nanovllm.engine.block_manager import BlockManager, hash_block
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

_ids = iter(range(10**9))


def seq_of(tokens):
    return Sequence(seq_id=next(_ids), request_id="r", prompt_token_ids=list(tokens), params=SamplingParams())


def compute_and_cache(bm, seq):
    """Allocate all of seq, count every token as computed, register its full blocks."""
    bm.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def test_pure_python_modules_do_not_import_torch():
    code = (
        "import sys; import nanovllm.engine.scheduler, nanovllm.engine.block_manager, nanovllm.engine.sequence;"
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_allocate_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq_of(range(10))
    assert bm.allocate(s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    bm.check_invariants([s])
    bm.free(s)
    assert bm.num_free_blocks == 8 and s.block_table == []
    bm.check_invariants([])


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq_of(range(12))
    assert not bm.allocate(s, 12)
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_double_free_raises():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = seq_of(range(4))
    bm.allocate(s, 4)
    table = list(s.block_table)
    bm.free(s)
    s.block_table = table
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(s)


def test_prefix_hit_after_computation_and_ref_counts():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq_of(range(10))
    assert bm.find_cached_prefix(a) == []
    compute_and_cache(bm, a)  # two full blocks registered
    b = seq_of(list(range(8)) + [99, 98, 97])
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_table[:2]
    assert bm.allocate(b, 3, hits)
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert bm.blocks[hits[0]].ref_count == 2
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    bm.check_invariants([])


def test_hit_never_covers_the_whole_prompt():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(range(8))
    compute_and_cache(bm, a)
    b = seq_of(range(8))
    assert len(bm.find_cached_prefix(b)) == 1  # the last token must still be computed


def test_freed_cached_blocks_are_reused_until_evicted():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq_of(range(9))
    compute_and_cache(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = seq_of(list(range(8)) + [5])
    assert len(bm.find_cached_prefix(b)) == 2  # still cached at ref count 0
    # Fill the pool with other data: the cached blocks are evicted, hits disappear.
    c = seq_of([7] * 16)
    assert bm.allocate(c, 16)
    assert bm.find_cached_prefix(b) == []
    bm.free(c)
    bm.check_invariants([])


def test_hit_verification_rejects_a_colliding_hash():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(range(9))
    compute_and_cache(bm, a)
    # Forge a collision: make b's first-block hash point at a's block although tokens differ.
    b = seq_of([50, 51, 52, 53, 54])
    forged = hash_block(0, [50, 51, 52, 53])
    bm.cached[forged] = a.block_table[0]
    assert bm.find_cached_prefix(b) == []


def test_hit_reusing_free_blocks_counts_them_correctly():
    """A hit on blocks with ref count 0 takes them from the free queue, so they cannot also
    serve as the new blocks: allocation must fail rather than hand out a block twice."""
    bm = BlockManager(num_blocks=3, block_size=4)
    a = seq_of(range(9))
    compute_and_cache(bm, a)
    bm.free(a)
    b = seq_of(list(range(8)) + list(range(100, 109)))  # 17 tokens: 2 hit + needs 3 more blocks
    hits = bm.find_cached_prefix(b)
    assert len(hits) == 2
    assert not bm.allocate(b, 9, hits)
    bm.check_invariants([])


def test_decode_filled_blocks_become_cacheable():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(range(3))
    bm.allocate(a, 3)
    a.num_computed_tokens = 3
    for t in (10, 11, 12, 13, 14):  # decode: tokens appended then computed one by one
        a.append_token(t)
        bm.allocate(a, 1)
        a.num_computed_tokens += 1
        bm.cache_full_blocks(a)
    b = seq_of([0, 1, 2, 10, 11, 12, 13, 14, 15])
    assert len(bm.find_cached_prefix(b)) == 2


def test_reset_prefix_cache_only_when_idle():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(range(9))
    compute_and_cache(bm, a)
    assert not bm.reset_prefix_cache()  # a still holds blocks
    bm.free(a)
    assert bm.reset_prefix_cache()
    assert bm.find_cached_prefix(seq_of(range(9))) == []
