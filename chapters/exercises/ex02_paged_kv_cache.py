"""Chapter 02 exercises: from a block table to cache slots, and giving blocks back.
Write each function's body; `make exercise CH=02` runs the engine and block manager tests with them.

They replace a method of the core (`ModelRunner._slots`, `KVCacheManager.free`): `self` is the
runner or the KV cache manager, with every attribute the core's has.
"""
import numpy as np

from minivllm.core.sequence import Sequence


def _slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
    """Exercise 02.1: the cache slot of each token position in [start, end) of `seq`
    (chapter 02, "From block table to slot"). Replaces ModelRunner._slots.

    The KV cache is [num_blocks, block_size, ...], viewed as num_blocks * block_size slots.
    Position p of a sequence lives in its logical block p // block_size, which the sequence's block
    table maps to a physical block: slot = seq.block_table[p // block_size] * block_size
    + p % block_size. self.block_size is the block size.

    Returns an integer numpy array of end - start slots (the engine writes each token's K/V there).
    """
    raise NotImplementedError("exercise 02.1 (_slots) is not written yet: fill it in, "
                              "chapters/exercises/ex02_paged_kv_cache.py; read chapters/02_paged_kv_cache.md, "
                              "'From block table to slot'")


def free(self, seq: Sequence) -> None:
    """Exercise 02.2: give back `seq`'s blocks (chapter 02, "KVCacheManager"). Replaces
    KVCacheManager.free; called when a sequence finishes or is preempted.

    Blocks can be shared (prefix caching, chapter 04), so a block is not simply freed: drop one
    reference with self.pool.release(block_id) (at 0 the block joins the end of the free queue,
    keeping its hash: a later prompt with the same prefix can still find it). Go through the
    block table from its last block to its first, so the tail is recycled before the more
    shareable prefix. Then empty the sequence's block table and forget how many of its blocks are
    registered (self.num_registered_blocks.pop(seq.seq_id, None)).
    """
    raise NotImplementedError("exercise 02.2 (free) is not written yet: fill it in, "
                              "chapters/exercises/ex02_paged_kv_cache.py; read chapters/02_paged_kv_cache.md, "
                              "'KVCacheManager'")
