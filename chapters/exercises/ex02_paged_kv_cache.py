"""Chapter 02 exercises: from a block table to cache slots, and the block pool behind the KV cache.
Write the function and the class; `make exercise CH=02` runs the engine's and the KV cache manager's
tests with them. Stuck? chapters/exercises/hints/02_paged_kv_cache.md, one level at a time.

02.1 replaces the method ModelRunner._slots (`self` is the runner, with every attribute the core's
has). 02.2 replaces the class BlockPool of minivllm/core/kv_cache_manager.py: KVCacheManager builds
one (`self.pool = BlockPool(num_blocks)`) and calls the methods below.
"""
import numpy as np

from minivllm.core import kv_cache_manager
from minivllm.core.kv_cache_manager import Block
from minivllm.core.sequence import Sequence


def _slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
    """Exercise 02.1: the cache slot of each token position in [start, end) of `seq`
    (chapter 02, "From block table to slot"). Replaces ModelRunner._slots.

    The KV cache is [num_blocks, block_size, ...]; its slots number those positions block after
    block (slot s is offset s % block_size of physical block s // block_size). Position p of a
    sequence is at offset p % block_size of its logical block p // block_size, and seq.block_table
    maps logical blocks to physical ones. self.block_size is the block size.

    Returns an integer numpy array of end - start slots (the engine writes each token's K/V there).
    """
    raise NotImplementedError("exercise 02.1 (_slots) is not written yet: fill it in, "
                              "chapters/exercises/ex02_paged_kv_cache.py; read chapters/02_paged_kv_cache.md, "
                              "'From block table to slot'")


def _not_written(method: str) -> NotImplementedError:
    return NotImplementedError(f"exercise 02.2 (BlockPool) is not written yet: BlockPool.{method}; fill it in, "
                               "chapters/exercises/ex02_paged_kv_cache.py; read chapters/02_paged_kv_cache.md, "
                               "'KVCacheManager'")


class BlockPool:
    """Exercise 02.2: every KV block, its reference count and the free queue (chapter 02,
    "KVCacheManager"; chapter 04, "Freed blocks keep their hash; LRU recycling").

    Attributes that other code reads (keep the names):
        num_blocks:        block ids are 0 .. num_blocks - 1
        blocks:            dict, block id -> Block (kv_cache_manager.Block: block_id, ref_count, hash)
                           for every block used so far
        hash_to_block_id:  dict, the prefix cache's table (chapter 04): starts empty; the given
                           register and unregister keep it

    The free queue holds exactly the blocks whose ref_count is 0, in the order allocate hands them
    out: blocks never used yet first, by id, then freed blocks, least recently freed first. A freed
    block keeps its hash (its K/V is still a cached prefix) until allocate hands it out again.
    A block with references (ref_count > 0) is in no queue: it is in use, maybe by several
    sequences at once (a shared prefix).

    Building a pool must cost the same for ten blocks as for ten million (a small model on a big GPU
    gets millions): nothing per block before the block is first used.
    """

    # Given: the hash table of full blocks (chapter 04). They use self.block and self.hash_to_block_id.
    register = kv_cache_manager.BlockPool.register
    unregister = kv_cache_manager.BlockPool.unregister

    def __init__(self, num_blocks: int):
        raise _not_written("__init__")

    @property
    def num_free_blocks(self) -> int:
        """How many blocks have ref_count 0 (never used or freed; cached ones count as free)."""
        raise _not_written("num_free_blocks")

    def block(self, block_id: int) -> Block:
        """The Block of `block_id`, made the first time it is asked for. IndexError for an id
        outside 0 .. num_blocks - 1."""
        raise _not_written("block")

    def free_block_ids(self) -> list[int]:
        """The free queue as a list: the block that allocate hands out next comes first."""
        raise _not_written("free_block_ids")

    def allocate(self) -> int:
        """Take the head of the free queue and return its id, with ref_count 1; it forgets the
        prefix it cached (self.unregister). AssertionError if no block is free (the manager asks
        num_free_blocks first)."""
        raise _not_written("allocate")

    def touch(self, block_id: int) -> None:
        """One more reference to `block_id` (a block that a prefix-cache hit shares, chapter 04).
        A block that was free leaves the free queue, from wherever it is in it."""
        raise _not_written("touch")

    def release(self, block_id: int) -> None:
        """One reference less to `block_id`; at 0 the block joins the back of the free queue and
        keeps its hash."""
        raise _not_written("release")
