"""Block manager scenarios with exact block ids (vLLM: tests/v1/core/test_prefix_caching.py)."""
import random

import pytest

from minivllm.engine.block_manager import BlockManager, compute_block_hash
from minivllm.engine.sequence import Sequence

BS = 4  # block size


def make_seq(token_ids):
    return Sequence(list(token_ids), block_size=BS)


def prefill(bm, seq):
    """What a whole-prompt prefill step does: allocate, then register the blocks it fills."""
    bm.allocate(seq)
    bm.commit_blocks(seq, seq.num_computed_tokens, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens


def grow(bm, seq, token_id):
    """What one decode step does to the cache bookkeeping."""
    seq.append_token(token_id)
    assert bm.can_append(seq)
    bm.may_append(seq)


def ref_counts(bm):
    return [b.ref_count for b in bm.blocks]


def test_allocate_share_append_free_hit_recycle():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(10))  # blocks: [0 1 2 3][4 5 6 7][8 9]
    assert bm.can_allocate(a)
    prefill(bm, a)
    assert a.block_table == [0, 1, 2] and a.num_cached_tokens == 0
    assert list(bm.free_block_ids) == [3, 4, 5, 6, 7]

    # b shares a's first two full blocks, then differs.
    b = make_seq([0, 1, 2, 3, 4, 5, 6, 7, 100, 101])
    prefill(bm, b)
    assert b.block_table == [0, 1, 3] and b.num_cached_tokens == 8 and b.num_cached_blocks == 2
    assert b.num_prompt_cached_tokens == 8 and a.num_prompt_cached_tokens == 0
    assert ref_counts(bm)[:4] == [2, 2, 1, 1]
    assert bm.num_cached_tokens_hit == 8 and bm.num_prompt_tokens_queried == 20

    # a decodes across a block boundary: 11 and 12 tokens stay in block 2, the 13th opens block 4.
    grow(bm, a, 10)
    grow(bm, a, 11)
    assert a.block_table == [0, 1, 2]
    grow(bm, a, 12)
    assert a.block_table == [0, 1, 2, 4]
    assert list(bm.free_block_ids) == [5, 6, 7]

    # Freeing returns tail blocks first; shared blocks only drop a reference.
    bm.deallocate(a)
    assert a.block_table == [] and a.num_cached_tokens == 0
    assert list(bm.free_block_ids) == [5, 6, 7, 4, 2]
    assert ref_counts(bm)[:3] == [1, 1, 0]
    bm.deallocate(b)
    assert b.num_cached_tokens == 0 and b.num_prompt_cached_tokens == 8
    assert list(bm.free_block_ids) == [5, 6, 7, 4, 2, 3, 1, 0]
    assert ref_counts(bm) == [0] * 8 and bm.num_free_blocks == 8

    # c hits freed blocks, including block 2 that decoding filled; they leave the free queue.
    c = make_seq(list(range(13)) + [99])
    prefill(bm, c)
    assert c.block_table == [0, 1, 2, 5] and c.num_cached_tokens == 12
    assert list(bm.free_block_ids) == [6, 7, 4, 3]

    # Recycling takes the least recently freed block first and drops its hash.
    bm.deallocate(c)
    assert list(bm.free_block_ids) == [6, 7, 4, 3, 5, 2, 1, 0]
    d = make_seq(range(200, 216))  # 4 blocks: 6, 7, 4, 3
    prefill(bm, d)
    assert d.block_table == [6, 7, 4, 3] and d.num_cached_tokens == 0
    assert bm.get_num_cached_tokens(make_seq(range(14))) == 12
    e = make_seq(range(300, 308))  # 2 blocks: 5, then 2, which cached a's third block
    prefill(bm, e)
    assert e.block_table == [5, 2]
    assert bm.get_num_cached_tokens(make_seq(range(14))) == 8  # block 2's prefix is gone
    assert list(bm.free_block_ids) == [1, 0]
    for seq in (d, e):
        bm.deallocate(seq)
    assert ref_counts(bm) == [0] * 8 and bm.num_free_blocks == 8


def test_fully_cached_prompt_recomputes_its_last_block():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = make_seq(range(8))  # exactly two full blocks
    prefill(bm, a)
    assert a.block_table == [0, 1]
    bm.deallocate(a)
    again = make_seq(range(8))
    prefill(bm, again)
    # Block 1 holds the prompt's last token, which must be computed: only block 0 is a hit.
    assert again.block_table == [0, 2] and again.num_cached_tokens == 4
    assert bm.hash_to_block_id[compute_block_hash(compute_block_hash(None, [0, 1, 2, 3]), [4, 5, 6, 7])] == 1
    longer = make_seq(range(9))
    prefill(bm, longer)  # now token 7 is not last: both full blocks hit
    assert longer.block_table == [0, 1, 3] and longer.num_cached_tokens == 8
    single = make_seq([0])
    prefill(bm, single)
    assert single.num_cached_tokens == 0


def test_reset_prefix_cache():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(10))
    prefill(bm, a)
    assert not bm.reset_prefix_cache()  # refused while blocks are in use
    assert len(bm.hash_to_block_id) == 2
    bm.deallocate(a)
    assert bm.reset_prefix_cache()
    assert not bm.hash_to_block_id and all(b.hash is None for b in bm.blocks)
    again = make_seq(range(10))
    prefill(bm, again)
    assert again.num_cached_tokens == 0


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=False)
    a, b = make_seq(range(9)), make_seq(range(9))
    prefill(bm, a)
    prefill(bm, b)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4, 5]
    assert b.num_cached_tokens == 0 and bm.hash_to_block_id == {} and bm.num_cached_tokens_hit == 0


def test_can_allocate_counts_hits_on_blocks_in_use_as_free():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(range(9))
    prefill(bm, a)  # blocks 0, 1, 2; one block free
    b = make_seq(list(range(8)) + [50])  # needs 3 blocks, 2 of them shared with a
    assert bm.get_num_cached_tokens(b) == 8
    assert bm.can_allocate(b)
    prefill(bm, b)
    assert b.block_table == [0, 1, 3] and bm.num_free_blocks == 0
    c = make_seq(list(range(8)) + [60])
    assert not bm.can_allocate(c)  # shares 2 blocks but has no room for its third


def test_can_append_needs_a_block_only_at_a_boundary():
    bm = BlockManager(num_blocks=2, block_size=BS)
    a = make_seq(range(7))
    prefill(bm, a)
    grow(bm, a, 7)  # fills block 1
    assert bm.num_free_blocks == 0
    a.append_token(8)  # would open a third block
    assert not bm.can_append(a)


def test_chunks_register_only_the_blocks_they_fill():
    """A block becomes findable only once a scheduled chunk fills it, never at allocation: its
    KV is written by that chunk's step."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(11))  # blocks [0 1 2 3][4 5 6 7][8 9 10]
    bm.allocate(a)
    assert a.block_table == [0, 1, 2] and a.num_computed_tokens == 0 and not bm.hash_to_block_id
    bm.commit_blocks(a, 0, 6)  # chunk [0, 6): fills block 0 only, ends mid-block 1
    assert list(bm.hash_to_block_id.values()) == [0]
    assert bm.get_num_cached_tokens(make_seq(range(11))) == 4
    bm.commit_blocks(a, 6, 9)  # chunk [6, 9): fills block 1 (started by the previous chunk)
    assert list(bm.hash_to_block_id.values()) == [0, 1]
    bm.commit_blocks(a, 9, 11)  # the last, partial block stays unregistered
    assert list(bm.hash_to_block_id.values()) == [0, 1]
    b = make_seq(list(range(8)) + [70, 71])
    bm.allocate(b)
    assert b.block_table == [0, 1, 3] and b.num_cached_tokens == b.num_computed_tokens == 8
    bm.deallocate(b)
    assert b.num_computed_tokens == 0


def test_hash_chains_the_whole_prefix():
    h0 = compute_block_hash(None, [1, 2, 3, 4])
    assert compute_block_hash(h0, [5, 6, 7, 8]) != compute_block_hash(compute_block_hash(None, [9, 2, 3, 4]), [5, 6, 7, 8])
    assert compute_block_hash(None, [1, 2]) != compute_block_hash(None, [2, 1])
    assert compute_block_hash(None, [2**40]) != compute_block_hash(None, [0])


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_keep_invariants(seed):
    """Random allocate / decode / free; a hit must always point at blocks holding the same tokens."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=24, block_size=BS)
    # block id -> the prefix through that block when its KV was written (a token's KV depends on
    # every token before it, so a hit must match the whole prefix, not just the block's tokens)
    contents = {}
    running = []
    prefixes = [[rng.randrange(3) for _ in range(12)] for _ in range(3)]
    for _ in range(400):
        op = rng.random()
        if op < 0.3:
            seq = make_seq(rng.choice(prefixes)[:rng.randrange(1, 13)] + [rng.randrange(3) for _ in range(rng.randrange(0, 6))])
            if not bm.can_allocate(seq):
                continue
            prefill(bm, seq)
            for i, block_id in enumerate(seq.block_table):
                if i < seq.num_cached_blocks:
                    assert contents[block_id] == seq.token_ids[:(i + 1) * BS], "hit on a block of another prefix"
                else:
                    contents[block_id] = seq.token_ids[:(i + 1) * BS]
            running.append(seq)
        elif op < 0.8 and running:
            seq = rng.choice(running)
            seq.append_token(rng.randrange(3))
            if not bm.can_append(seq):
                seq.token_ids.pop()
                continue
            bm.may_append(seq)
            i = seq.num_blocks - 1
            contents[seq.block_table[i]] = seq.token_ids[:(i + 1) * BS]
        elif running:
            bm.deallocate(running.pop(rng.randrange(len(running))))
        expected_refs = [0] * bm.num_blocks
        for seq in running:
            assert len(seq.block_table) == seq.num_blocks
            for block_id in seq.block_table:
                expected_refs[block_id] += 1
        assert ref_counts(bm) == expected_refs
        assert set(bm.free_block_ids) == {i for i, r in enumerate(expected_refs) if r == 0}
        for h, block_id in bm.hash_to_block_id.items():
            assert bm.blocks[block_id].hash == h
    for seq in running:
        bm.deallocate(seq)
    assert bm.num_free_blocks == bm.num_blocks and ref_counts(bm) == [0] * bm.num_blocks
    assert bm.num_cached_tokens_hit > 0


def test_uncache_blocks_after_a_failed_step():
    """A failed step: its sequences' registered blocks leave the prefix cache (their KV may never have
    been written) while blocks cached by completed work stay findable."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    done = make_seq(range(12))  # [0 1 2 3][4 5 6 7][8 9 10 11]: computed and finished
    prefill(bm, done)
    bm.deallocate(done)
    failed = make_seq(list(range(8)) + [50, 51, 52, 53, 54])  # hits 2 blocks, registers [50..53]
    prefill(bm, failed)
    assert failed.block_table == [0, 1, 3, 4] and failed.num_cached_tokens == 8
    grow(bm, failed, 55)
    grow(bm, failed, 56)
    grow(bm, failed, 57)  # fills [54 55 56 57]: registered by the decode step
    assert len(bm.hash_to_block_id) == 5
    bm.uncache_blocks(failed)
    assert failed.block_table == [0, 1, 3, 4] and ref_counts(bm)[:5] == [1, 1, 0, 1, 1]  # still allocated
    assert all(bm.blocks[b].hash is None for b in failed.block_table)
    assert list(bm.hash_to_block_id.values()) == [2]  # only `done`'s third block, which `failed` never held
    bm.deallocate(failed)
    again = make_seq(list(range(8)) + [50, 51, 52, 53, 54, 55, 56, 57, 58])
    assert bm.get_num_cached_tokens(again) == 0
    assert bm.get_num_cached_tokens(make_seq(range(13))) == 0  # `done`'s first blocks were dropped too
