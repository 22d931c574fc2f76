"""KV cache manager scenarios with exact block ids (vLLM: tests/v1/core/test_prefix_caching.py).

They grade exercises 02.2 (BlockPool) and 04.1 (get_computed_blocks, allocate_slots and cache_blocks);
the known wrong answers at the end must fail them (the grader can fail).
"""
import random
import tracemalloc

import pytest

from minivllm.core import kv_cache_manager
from minivllm.core.kv_cache_manager import ComputedBlocks, KVCacheManager, compute_block_hashes
from minivllm.core.sequence import Sequence
from wrong_answers import builds_on_the_engine, case_id, rejected

BS = 4  # block size


def make_seq(token_ids):
    return Sequence(list(token_ids), block_size=BS)


def block_hash(prev_hash, token_ids):
    return compute_block_hashes(prev_hash, list(token_ids), len(token_ids))[0]


def prefill(kv, seq):
    """What admitting a whole prompt and prefilling it does: take its cached prefix, allocate the
    rest, register the blocks the step fills."""
    computed = kv.get_computed_blocks(seq)
    assert kv.allocate_slots(seq, seq.num_tokens - computed.num_tokens, computed)
    seq.num_cached_tokens, seq.num_computed_tokens = computed.num_tokens, seq.num_tokens
    kv.cache_blocks(seq, seq.num_tokens)


def grow(kv, seq, token_id):
    """What one decode step does to the cache bookkeeping (the token's KV is written by it)."""
    seq.append_token(token_id)
    assert kv.allocate_slots(seq, 1)
    seq.num_computed_tokens += 1
    kv.cache_blocks(seq, seq.num_computed_tokens)


def ref_counts(kv):
    return [kv.pool.block(i).ref_count for i in range(kv.num_blocks)]


def cached_tokens(kv, token_ids):
    return kv.get_computed_blocks(make_seq(token_ids)).num_tokens


def test_block_pool_free_queue_order():
    """The pool alone: never-used blocks first, by id, then freed ones, least recently freed first; a
    shared block is free only at its last release; a hit takes a block out of the middle of the queue;
    recycling a block drops its hash."""
    pool = kv_cache_manager.BlockPool(6)  # looked up here, so that the known wrong answers below replace it
    assert pool.num_free_blocks == 6 and pool.free_block_ids() == [0, 1, 2, 3, 4, 5]
    assert [pool.allocate() for _ in range(4)] == [0, 1, 2, 3]
    assert pool.free_block_ids() == [4, 5] and pool.num_free_blocks == 2
    pool.touch(1)  # shared: two references
    pool.release(3)
    pool.release(1)  # one reference left: still in use
    pool.release(0)
    assert pool.free_block_ids() == [4, 5, 3, 0] and pool.num_free_blocks == 4
    assert [pool.block(i).ref_count for i in range(6)] == [0, 1, 1, 0, 0, 0]
    pool.release(1)
    assert pool.free_block_ids() == [4, 5, 3, 0, 1]
    h = block_hash(None, [1, 2, 3, 4])
    pool.register(3, h)  # block 3 holds a cached prefix: free, and findable
    pool.touch(3)  # a prefix-cache hit takes it out of the middle of the queue
    assert pool.free_block_ids() == [4, 5, 0, 1] and pool.block(3).ref_count == 1
    pool.release(3)  # free again: to the back, still findable
    assert pool.free_block_ids() == [4, 5, 0, 1, 3] and pool.hash_to_block_id == {h: 3}
    assert [pool.allocate() for _ in range(4)] == [4, 5, 0, 1]
    assert pool.hash_to_block_id == {h: 3} and pool.block(3).hash == h
    assert pool.allocate() == 3  # recycled last, and only then its prefix is gone
    assert pool.hash_to_block_id == {} and pool.block(3).hash is None
    assert pool.num_free_blocks == 0 and pool.free_block_ids() == []
    assert [pool.block(i).ref_count for i in range(6)] == [1] * 6
    with pytest.raises(IndexError):
        pool.block(6)


def test_a_big_pool_starts_at_once():
    """Nothing per block before its first use: a small model on a big GPU gets millions of blocks
    (an entry per block would take ~100 bytes each here, 10 MB)."""
    tracemalloc.start()
    try:
        pool = kv_cache_manager.BlockPool(100_000)
        num_bytes, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert num_bytes < 50_000, f"building a pool of 100,000 blocks took {num_bytes} bytes"
    assert pool.num_free_blocks == 100_000 and pool.allocate() == 0 and pool.allocate() == 1
    pool.release(0)
    assert pool.num_free_blocks == 99_999 and pool.block(99_999).ref_count == 0


def test_allocate_share_append_free_hit_recycle():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_seq(range(10))  # blocks: [0 1 2 3][4 5 6 7][8 9]
    prefill(kv, a)
    assert a.block_table == [0, 1, 2] and a.num_cached_tokens == 0
    assert kv.pool.free_block_ids() == [3, 4, 5, 6, 7]

    # b shares a's first two full blocks, then differs.
    b = make_seq([0, 1, 2, 3, 4, 5, 6, 7, 100, 101])
    prefill(kv, b)
    assert b.block_table == [0, 1, 3] and b.num_cached_tokens == 8
    assert ref_counts(kv)[:4] == [2, 2, 1, 1]
    assert kv.num_cached_tokens_hit == 8 and kv.num_prompt_tokens_queried == 20

    # a decodes across a block boundary: 11 and 12 tokens stay in block 2, the 13th opens block 4.
    grow(kv, a, 10)
    grow(kv, a, 11)
    assert a.block_table == [0, 1, 2]
    grow(kv, a, 12)
    assert a.block_table == [0, 1, 2, 4]
    assert kv.pool.free_block_ids() == [5, 6, 7]

    # Freeing returns tail blocks first; shared blocks only drop a reference.
    kv.free(a)
    assert a.block_table == []
    assert kv.pool.free_block_ids() == [5, 6, 7, 4, 2]
    assert ref_counts(kv)[:3] == [1, 1, 0]
    kv.free(b)
    assert kv.pool.free_block_ids() == [5, 6, 7, 4, 2, 3, 1, 0]
    assert ref_counts(kv) == [0] * 8 and kv.num_free_blocks == 8 and kv.usage == 0.0

    # c hits freed blocks, including block 2 that decoding filled; they leave the free queue.
    c = make_seq(list(range(13)) + [99])
    prefill(kv, c)
    assert c.block_table == [0, 1, 2, 5] and c.num_cached_tokens == 12
    assert kv.pool.free_block_ids() == [6, 7, 4, 3] and kv.usage == 0.5

    # Recycling takes the least recently freed block first and drops its hash.
    kv.free(c)
    assert kv.pool.free_block_ids() == [6, 7, 4, 3, 5, 2, 1, 0]
    d = make_seq(range(200, 216))  # 4 blocks: 6, 7, 4, 3
    prefill(kv, d)
    assert d.block_table == [6, 7, 4, 3] and d.num_cached_tokens == 0
    assert cached_tokens(kv, range(14)) == 12
    e = make_seq(range(300, 308))  # 2 blocks: 5, then 2, which cached a's third block
    prefill(kv, e)
    assert e.block_table == [5, 2]
    assert cached_tokens(kv, range(14)) == 8  # block 2's prefix is gone
    assert kv.pool.free_block_ids() == [1, 0]
    for seq in (d, e):
        kv.free(seq)
    assert ref_counts(kv) == [0] * 8 and kv.num_free_blocks == 8


def test_fully_cached_prompt_recomputes_its_last_block():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_seq(range(8))  # exactly two full blocks
    prefill(kv, a)
    assert a.block_table == [0, 1]
    kv.free(a)
    again = make_seq(range(8))
    prefill(kv, again)
    # Block 1 holds the prompt's last token, which must be computed: only block 0 is a hit.
    assert again.block_table == [0, 2] and again.num_cached_tokens == 4
    assert kv.pool.hash_to_block_id[block_hash(block_hash(None, [0, 1, 2, 3]), [4, 5, 6, 7])] == 1
    longer = make_seq(range(9))
    prefill(kv, longer)  # now token 7 is not last: both full blocks hit
    assert longer.block_table == [0, 1, 3] and longer.num_cached_tokens == 8
    single = make_seq([0])
    prefill(kv, single)
    assert single.num_cached_tokens == 0


def test_reset_prefix_cache():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_seq(range(10))
    prefill(kv, a)
    assert not kv.reset_prefix_cache()  # refused while blocks are in use
    assert len(kv.pool.hash_to_block_id) == 2
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert not kv.pool.hash_to_block_id and all(b.hash is None for b in kv.pool.blocks.values())
    again = make_seq(range(10))
    prefill(kv, again)
    assert again.num_cached_tokens == 0


def test_prefix_caching_off():
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_prefix_caching=False)
    a, b = make_seq(range(9)), make_seq(range(9))
    prefill(kv, a)
    prefill(kv, b)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4, 5]
    assert b.num_cached_tokens == 0 and kv.pool.hash_to_block_id == {} and kv.num_cached_tokens_hit == 0


def test_hits_on_blocks_in_use_cost_no_free_block():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_seq(range(9))
    prefill(kv, a)  # blocks 0, 1, 2; one block free
    b = make_seq(list(range(8)) + [50])  # needs 3 blocks, 2 of them shared with a
    assert kv.get_computed_blocks(b).block_ids == [0, 1]
    prefill(kv, b)
    assert b.block_table == [0, 1, 3] and kv.num_free_blocks == 0
    c = make_seq(list(range(8)) + [60])  # shares 2 blocks but has no room for its third
    computed = kv.get_computed_blocks(c)
    assert not kv.allocate_slots(c, 1, computed)
    assert c.block_table == [] and ref_counts(kv) == [2, 2, 1, 1]  # nothing changed


def test_hits_on_free_cached_blocks_take_them_from_the_free_queue():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_seq(range(9))
    prefill(kv, a)
    kv.free(a)  # blocks 0, 1 cached and free, 2 free
    b = make_seq(list(range(8)) + [7, 7, 7, 7, 7])  # hits 0, 1 (free) and needs two more blocks: 4 > 3
    assert not kv.allocate_slots(b, 5, kv.get_computed_blocks(b))
    assert kv.num_free_blocks == 3 and kv.pool.free_block_ids() == [2, 1, 0]


def test_a_decode_needs_a_block_only_at_a_boundary():
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    a = make_seq(range(7))
    prefill(kv, a)
    grow(kv, a, 7)  # fills block 1
    assert kv.num_free_blocks == 0
    a.append_token(8)  # would open a third block
    assert not kv.allocate_slots(a, 1)


def test_chunks_register_only_the_blocks_they_fill():
    """A block becomes findable only once a scheduled chunk fills it, never at allocation: its
    KV is written by that chunk's step."""
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_seq(range(11))  # blocks [0 1 2 3][4 5 6 7][8 9 10]
    assert kv.allocate_slots(a, 11)
    assert a.block_table == [0, 1, 2] and not kv.pool.hash_to_block_id
    kv.cache_blocks(a, 6)  # chunk [0, 6): fills block 0 only, ends mid-block 1
    assert list(kv.pool.hash_to_block_id.values()) == [0]
    assert cached_tokens(kv, range(11)) == 4
    kv.cache_blocks(a, 9)  # chunk [6, 9): fills block 1 (started by the previous chunk)
    assert list(kv.pool.hash_to_block_id.values()) == [0, 1]
    kv.cache_blocks(a, 11)  # the last, partial block stays unregistered
    assert list(kv.pool.hash_to_block_id.values()) == [0, 1]
    b = make_seq(list(range(8)) + [70, 71])
    prefill(kv, b)
    assert b.block_table == [0, 1, 3] and b.num_cached_tokens == 8


def test_hash_chains_the_whole_prefix():
    h0 = block_hash(None, [1, 2, 3, 4])
    assert block_hash(h0, [5, 6, 7, 8]) != block_hash(block_hash(None, [9, 2, 3, 4]), [5, 6, 7, 8])
    assert block_hash(None, [1, 2]) != block_hash(None, [2, 1])
    assert block_hash(None, [2**40]) != block_hash(None, [0])
    assert compute_block_hashes(None, list(range(10)), 4) == [h0 := block_hash(None, [0, 1, 2, 3]),
                                                            block_hash(h0, [4, 5, 6, 7])]  # full blocks only


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_keep_invariants(seed):
    """Random allocate / decode / free; a hit must always point at blocks holding the same tokens."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=24, block_size=BS)
    # block id -> the prefix through that block when its KV was written (a token's KV depends on
    # every token before it, so a hit must match the whole prefix, not just the block's tokens)
    contents = {}
    running = []
    prefixes = [[rng.randrange(3) for _ in range(12)] for _ in range(3)]
    for _ in range(400):
        op = rng.random()
        if op < 0.3:
            seq = make_seq(rng.choice(prefixes)[:rng.randrange(1, 13)] + [rng.randrange(3) for _ in range(rng.randrange(0, 6))])
            computed = kv.get_computed_blocks(seq)
            if not kv.allocate_slots(seq, seq.num_tokens - computed.num_tokens, computed):
                assert seq.block_table == []
                continue
            seq.num_computed_tokens = seq.num_tokens
            kv.cache_blocks(seq, seq.num_tokens)
            for i, block_id in enumerate(seq.block_table):
                if i < len(computed.block_ids):
                    assert contents[block_id] == seq.token_ids[:(i + 1) * BS], "hit on a block of another prefix"
                else:
                    contents[block_id] = seq.token_ids[:(i + 1) * BS]
            running.append(seq)
        elif op < 0.8 and running:
            seq = rng.choice(running)
            seq.append_token(rng.randrange(3))
            if not kv.allocate_slots(seq, 1):
                seq.token_ids.pop()
                continue
            seq.num_computed_tokens += 1
            kv.cache_blocks(seq, seq.num_computed_tokens)
            i = seq.num_blocks - 1
            contents[seq.block_table[i]] = seq.token_ids[:(i + 1) * BS]
        elif running:
            kv.free(running.pop(rng.randrange(len(running))))
        expected_refs = [0] * kv.num_blocks
        for seq in running:
            assert len(seq.block_table) == seq.num_blocks
            for block_id in seq.block_table:
                expected_refs[block_id] += 1
        assert ref_counts(kv) == expected_refs
        assert set(kv.pool.free_block_ids()) == {i for i, r in enumerate(expected_refs) if r == 0}
        for h, block_id in kv.pool.hash_to_block_id.items():
            assert kv.pool.block(block_id).hash == h
    for seq in running:
        kv.free(seq)
    assert kv.num_free_blocks == kv.num_blocks and ref_counts(kv) == [0] * kv.num_blocks
    assert kv.num_cached_tokens_hit > 0


def test_uncache_blocks_after_a_failed_step():
    """A failed step: its sequences' registered blocks leave the prefix cache (their KV may never have
    been written) while blocks cached by completed work stay findable."""
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    done = make_seq(range(12))  # [0 1 2 3][4 5 6 7][8 9 10 11]: computed and finished
    prefill(kv, done)
    kv.free(done)
    failed = make_seq(list(range(8)) + [50, 51, 52, 53, 54])  # hits 2 blocks, registers [50..53]
    prefill(kv, failed)
    assert failed.block_table == [0, 1, 3, 4] and failed.num_cached_tokens == 8
    grow(kv, failed, 55)
    grow(kv, failed, 56)
    grow(kv, failed, 57)  # fills [54 55 56 57]: registered by the decode step
    assert len(kv.pool.hash_to_block_id) == 5
    kv.uncache_blocks(failed)
    assert failed.block_table == [0, 1, 3, 4] and ref_counts(kv)[:5] == [1, 1, 0, 1, 1]  # still allocated
    assert all(kv.pool.block(b).hash is None for b in failed.block_table)
    assert list(kv.pool.hash_to_block_id.values()) == [2]  # only `done`'s third block, which `failed` never held
    kv.free(failed)
    assert cached_tokens(kv, list(range(8)) + [50, 51, 52, 53, 54, 55, 56, 57, 58]) == 0
    assert cached_tokens(kv, range(13)) == 0  # `done`'s first blocks were dropped too


# ------------------------------------------------------------------------------------------------
# Known wrong answers: each must fail the tests that grade exercises 02.2 and 04.1
# ------------------------------------------------------------------------------------------------

class LifoPool(kv_cache_manager.BlockPool):
    """Freed blocks go to the front: the freshest cached prefix is recycled first."""

    def release(self, block_id):
        super().release(block_id)
        if block_id in self.freed:
            self.freed.move_to_end(block_id, last=False)


class MostRecentlyFreedFirstPool(kv_cache_manager.BlockPool):
    """allocate takes the back of the free queue."""

    def allocate(self):
        if not self.freed:
            return super().allocate()
        block_id, _ = self.freed.popitem(last=True)
        self.unregister(block_id)
        self.block(block_id).ref_count = 1
        return block_id


class NoRefCountPool(kv_cache_manager.BlockPool):
    """release frees the block at once, though another sequence still shares it."""

    def release(self, block_id):
        self.blocks[block_id].ref_count = 0
        self.freed[block_id] = None


class TouchLeavesItQueuedPool(kv_cache_manager.BlockPool):
    """touch counts the reference but leaves a free block in the free queue."""

    def touch(self, block_id):
        self.block(block_id).ref_count += 1


class RecycledKeepsItsHashPool(kv_cache_manager.BlockPool):
    """A recycled block stays in the hash table: a later prompt hits K/V that was overwritten."""

    def unregister(self, block_id):
        pass


class FreedBeforeNeverUsedPool(kv_cache_manager.BlockPool):
    """allocate recycles a freed block while never-used ones are left: cached prefixes die early."""

    def allocate(self):
        if not self.freed:
            return super().allocate()
        block_id, _ = self.freed.popitem(last=False)
        self.unregister(block_id)
        self.block(block_id).ref_count = 1
        return block_id


class EagerPool(kv_cache_manager.BlockPool):
    """Right answers, but builds an entry per block at start-up."""

    def __init__(self, num_blocks):
        super().__init__(num_blocks)
        self.next_unused = num_blocks
        self.freed.update(dict.fromkeys(range(num_blocks)))


POOL_CHECKS = [test_block_pool_free_queue_order, test_allocate_share_append_free_hit_recycle]


@builds_on_the_engine
@pytest.mark.parametrize("wrong_pool, checks", [
    *[(pool, POOL_CHECKS) for pool in (LifoPool, MostRecentlyFreedFirstPool, FreedBeforeNeverUsedPool,
                                        NoRefCountPool, TouchLeavesItQueuedPool, RecycledKeepsItsHashPool)],
    (EagerPool, [test_a_big_pool_starts_at_once]),
], ids=lambda x: x.__name__ if isinstance(x, type) else "checks")
def test_the_pool_checks_reject_a_wrong_pool(wrong_pool, checks):
    for check in checks:
        rejected(check, kv_cache_manager, "BlockPool", wrong_pool)


engine_get_computed_blocks = KVCacheManager.get_computed_blocks
engine_allocate_slots = KVCacheManager.allocate_slots
engine_cache_blocks = KVCacheManager.cache_blocks


def lookup_that_finds_nothing(self, seq):
    """The trivial answer: no prefix is ever cached."""
    return ComputedBlocks()


def lookup_of_the_first_block_only(self, seq):
    computed = engine_get_computed_blocks(self, seq)
    return ComputedBlocks(computed.block_ids[:1], len(computed.block_ids[:1]) * self.block_size)


def lookup_including_the_last_token(self, seq):
    """Counts the block of the last token too: a prompt cached whole computes no token."""
    block_ids = []
    for h in self._block_hashes(seq, seq.num_tokens // self.block_size):
        if h not in self.pool.hash_to_block_id:
            break
        block_ids.append(self.pool.hash_to_block_id[h])
    return ComputedBlocks(block_ids, len(block_ids) * self.block_size)


def lookup_that_takes_the_blocks(self, seq):
    """Takes a reference itself: the blocks are taken twice, or kept though the sequence does not fit."""
    computed = engine_get_computed_blocks(self, seq)
    for block_id in computed.block_ids:
        self.pool.touch(block_id)
    return computed


def allocate_without_reuse(self, seq, num_new_tokens, computed=None):
    """Computes the cached prefix again in new blocks."""
    return engine_allocate_slots(self, seq, num_new_tokens + (computed.num_tokens if computed else 0))


def allocate_without_a_reference(self, seq, num_new_tokens, computed=None):
    """Puts the cached blocks in the block table without a reference: a free one stays free."""
    if not engine_allocate_slots(self, seq, num_new_tokens, computed):
        return False
    for block_id in computed.block_ids if computed else []:
        self.pool.release(block_id)
    return True


def allocate_with_free_hits_for_nothing(self, seq, num_new_tokens, computed=None):
    """Counts only the new blocks: a hit on a free cached block is taken as if it cost nothing."""
    computed = computed or ComputedBlocks()
    num_tokens = seq.num_computed_tokens + computed.num_tokens + num_new_tokens
    num_new_blocks = -(-num_tokens // self.block_size) - len(seq.block_table) - len(computed.block_ids)
    if max(num_new_blocks, 0) > self.num_free_blocks:
        return False
    for block_id in computed.block_ids:
        self.pool.touch(block_id)
    seq.block_table += computed.block_ids + [self.pool.allocate() for _ in range(num_new_blocks)]
    return True


def registration_of_nothing(self, seq, num_tokens):
    """The trivial answer: no block is ever findable."""


def registration_a_block_late(self, seq, num_tokens):
    """Registers a block only once the next one has begun: a full block waits a step to be findable."""
    engine_cache_blocks(self, seq, max(num_tokens - self.block_size, 0))


def registration_without_the_chain(self, seq, num_tokens):
    """Hashes each block's tokens alone: equal blocks after different prefixes would share their K/V."""
    first, last = self.num_registered_blocks.get(seq.seq_id, 0), num_tokens // self.block_size
    if not self.enable_prefix_caching or last <= first:
        return
    for i in range(first, last):
        tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
        self.pool.register(seq.block_table[i], compute_block_hashes(None, tokens, self.block_size)[0])
    self.num_registered_blocks[seq.seq_id] = last


@builds_on_the_engine
@pytest.mark.parametrize("name, wrong, check", [
    ("get_computed_blocks", lookup_that_finds_nothing, test_allocate_share_append_free_hit_recycle),
    ("get_computed_blocks", lookup_of_the_first_block_only, test_allocate_share_append_free_hit_recycle),
    ("get_computed_blocks", lookup_including_the_last_token, test_fully_cached_prompt_recomputes_its_last_block),
    ("get_computed_blocks", lookup_that_takes_the_blocks, test_allocate_share_append_free_hit_recycle),
    ("get_computed_blocks", lookup_that_takes_the_blocks, test_hits_on_blocks_in_use_cost_no_free_block),
    ("allocate_slots", allocate_without_reuse, test_allocate_share_append_free_hit_recycle),
    ("allocate_slots", allocate_without_a_reference, test_allocate_share_append_free_hit_recycle),
    ("allocate_slots", allocate_with_free_hits_for_nothing, test_hits_on_free_cached_blocks_take_them_from_the_free_queue),
    ("cache_blocks", registration_of_nothing, test_allocate_share_append_free_hit_recycle),
    ("cache_blocks", registration_a_block_late, test_chunks_register_only_the_blocks_they_fill),
    ("cache_blocks", registration_without_the_chain, test_allocate_share_append_free_hit_recycle),
], ids=case_id)
def test_the_prefix_cache_checks_reject_a_wrong_lookup_allocation_or_registration(name, wrong, check):
    rejected(check, KVCacheManager, name, wrong)
