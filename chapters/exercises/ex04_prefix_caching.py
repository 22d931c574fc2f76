"""Chapter 04 exercises: prefix caching in the KV cache manager (minivllm/core/kv_cache_manager.py):
finding a prompt's cached prefix, and allocating a block table that reuses it. Write each method's
body; `make exercise CH=04` runs the KV cache manager's tests with them. Stuck?
chapters/exercises/hints/04_prefix_caching.md, one level at a time.

They replace methods of KVCacheManager: `self` is the manager, with every attribute the core's has
(self.block_size, self.enable_prefix_caching, and its block pool self.pool: block, touch, allocate,
hash_to_block_id). The scheduler admits a waiting sequence with
    computed = kv_cache_manager.get_computed_blocks(seq)
    kv_cache_manager.allocate_slots(seq, seq.num_tokens - computed.num_tokens, computed)
and before every later step calls allocate_slots(seq, num_new_tokens) alone.
"""
from minivllm.core.kv_cache_manager import ComputedBlocks
from minivllm.core.sequence import Sequence


def get_computed_blocks(self, seq: Sequence) -> ComputedBlocks:
    """Exercise 04.1: the longest cached prefix of a waiting `seq`, in whole blocks (chapter 04,
    "Chained block hashes" and "Never the last prompt token"). Replaces
    KVCacheManager.get_computed_blocks.

    A full block of the sequence is cached when self.pool.hash_to_block_id holds its hash, the one
    cache_blocks registered for the block that computed the same tokens after the same prefix:
        hash of block i = sha256(hash of block i-1 + block i's token ids).digest()
    with b"" before block 0 and each token id as 8 little-endian bytes, signed
    (array.array("q", ids).tobytes(), or int.to_bytes(8, "little", signed=True)). Write the chain
    here; the engine's compute_block_hashes is the same computation.

    Returns ComputedBlocks(block_ids, num_tokens): the physical ids of the sequence's leading
    blocks that are cached, in order, up to the first that is not; num_tokens = len(block_ids) *
    self.block_size.
    - The block that holds the sequence's last token never counts: that token's logits must be
      computed, so a prompt that is cached whole computes its last block again.
    - Nothing is found when self.enable_prefix_caching is False or seq.skip_reading_prefix_cache.
    - No side effects: the blocks found keep their reference counts and their place in the free
      queue (allocate_slots takes them, or not, if the sequence does not fit).
    """
    raise NotImplementedError("exercise 04.1 (get_computed_blocks) is not written yet: fill it in, "
                              "chapters/exercises/ex04_prefix_caching.py; read chapters/04_prefix_caching.md, "
                              "'Never the last prompt token'")


def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed=None) -> bool:
    """Exercise 04.2: room for the KV of `seq`'s next `num_new_tokens` tokens, reusing the cached
    prefix `computed` at an admission (chapter 04, "Freed blocks keep their hash; LRU recycling").
    Replaces KVCacheManager.allocate_slots.

    computed: what get_computed_blocks found (a ComputedBlocks), or None (no cached prefix: every
    call after the admission).

    On success (True), seq.block_table covers seq.num_computed_tokens + computed.num_tokens +
    num_new_tokens tokens: the blocks it had, then the computed blocks, then new blocks from
    self.pool.allocate(). Each computed block gains a reference (self.pool.touch), so a block that a
    running sequence holds is shared and a free one leaves the free queue.
    - Blocks are short when the new blocks plus the computed blocks that are free (ref_count 0:
      taking one costs a free block, as a new block does) exceed self.num_free_blocks; then return
      False and change nothing.
    - At an admission (the block table is empty) count the lookup: self.num_prompt_tokens_queried
      += seq.num_tokens, self.num_cached_tokens_hit += computed.num_tokens, and
      self.num_registered_blocks[seq.seq_id] = the number of computed blocks (they are in the hash
      table already; cache_blocks registers the ones after them).
    - Register no hash here: a block becomes findable once the step that writes it is scheduled.
    """
    raise NotImplementedError("exercise 04.2 (allocate_slots) is not written yet: fill it in, "
                              "chapters/exercises/ex04_prefix_caching.py; read chapters/04_prefix_caching.md, "
                              "'Freed blocks keep their hash; LRU recycling'")
