"""Chapter 04 exercise: the prefix cache of the KV cache manager (minivllm/core/kv_cache_manager.py):
finding a prompt's cached prefix, allocating a block table that reuses it, and registering the blocks a
step fills so that later prompts find them. Write the three methods' bodies (and the block hashes they
share: a helper of your own in this file); `make exercise CH=04` runs the KV cache manager's tests with
them. Stuck? chapters/exercises/hints/04_prefix_caching.md, one level at a time.

They replace methods of KVCacheManager: `self` is the manager, with every attribute the core's has
(self.block_size, self.enable_prefix_caching, self.num_free_blocks, the counters below, and its block
pool self.pool: block, touch, allocate, register, hash_to_block_id). free(seq) stays the engine's: it
releases the block table last block first and forgets self.num_registered_blocks[seq.seq_id]. The
scheduler admits a waiting sequence with
    computed = kv_cache_manager.get_computed_blocks(seq)
    kv_cache_manager.allocate_slots(seq, seq.num_tokens - computed.num_tokens, computed)
before every later step calls allocate_slots(seq, num_new_tokens) alone, and after scheduling a step's
tokens calls cache_blocks(seq, seq.num_computed_tokens).
"""
import hashlib  # noqa: F401 (for your block hashes)
from array import array  # noqa: F401 (for your block hashes)

from minivllm.core.kv_cache_manager import ComputedBlocks
from minivllm.core.sequence import Sequence


def get_computed_blocks(self, seq: Sequence) -> ComputedBlocks:
    """Exercise 04.1, the lookup: the longest cached prefix of a waiting `seq`, in whole blocks (chapter
    04, "Chained block hashes" and "Never the last prompt token"). Replaces KVCacheManager.get_computed_blocks.

    A full block of the sequence is cached when self.pool.hash_to_block_id holds its hash, the one
    cache_blocks registered for the block that computed the same tokens after the same prefix:
        hash of block i = sha256(hash of block i-1 + block i's token ids).digest()
    with b"" before block 0 and each token id as 8 little-endian bytes, signed
    (array("q", ids).tobytes(), or int.to_bytes(8, "little", signed=True)). Write the chain yourself
    (the engine's compute_block_hashes is the same computation; the tests check yours against it). A
    full block's hash never changes: seq.block_hashes, a list on the sequence (empty at first), may
    keep them so that each is computed once.

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
    """Exercise 04.1, the allocation: room for the KV of `seq`'s next `num_new_tokens` tokens, reusing
    the cached prefix `computed` at an admission (chapter 02, "KVCacheManager"; chapter 04, "Freed
    blocks keep their hash; LRU recycling"). Replaces KVCacheManager.allocate_slots.

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
    raise NotImplementedError("exercise 04.1 (allocate_slots) is not written yet: fill it in, "
                              "chapters/exercises/ex04_prefix_caching.py; read chapters/04_prefix_caching.md, "
                              "'Freed blocks keep their hash; LRU recycling'")


def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
    """Exercise 04.1, the registration: make the blocks that `seq`'s first `num_tokens` tokens fill
    findable by later prompts (chapter 04, "Chained block hashes"). Replaces KVCacheManager.cache_blocks.

    num_tokens: the sequence's tokens whose K/V the scheduled steps write, so far (the scheduler
    passes seq.num_computed_tokens after each prompt chunk and each decode token it schedules).

    - Every full block among those tokens (block i when (i + 1) * block_size <= num_tokens) is
      registered once: self.pool.register(seq.block_table[i], hash of block i), the chained hash of
      get_computed_blocks. A block only partly filled is not registered (yet).
    - self.num_registered_blocks[seq.seq_id] (absent: 0) counts the sequence's leading blocks that
      are registered already: the cached prefix allocate_slots took, then the blocks earlier calls
      registered. Register the blocks after them, then update the count.
    - Nothing is registered when self.enable_prefix_caching is False.
    """
    raise NotImplementedError("exercise 04.1 (cache_blocks) is not written yet: fill it in, "
                              "chapters/exercises/ex04_prefix_caching.py; read chapters/04_prefix_caching.md, "
                              "'Chained block hashes'")
