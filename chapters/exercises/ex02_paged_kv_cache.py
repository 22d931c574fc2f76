"""Chapter 02 exercises: a step's inputs for the model, with the cache slot of every new token, and the
block pool behind the KV cache. Write the runner's four methods and the class; `make exercise CH=02`
runs the engine's, the input packing's and the KV cache manager's tests with them. Stuck?
chapters/exercises/hints/02_paged_kv_cache.md, one level at a time.

02.1 replaces four methods of minivllm/core/model_runner.py's ModelRunner (`self` is the runner:
self.block_size and self.max_num_blocks_per_seq are what they need): prepare_prefill and prepare_decode,
which the runner calls for every step, and the two helpers they share, _slots and _block_tables.
02.2 replaces the class BlockPool of minivllm/core/kv_cache_manager.py: KVCacheManager builds one
(`self.pool = BlockPool(num_blocks)`) and calls the methods below.
"""
import numpy as np  # noqa: F401 (for your step inputs)

from minivllm.core import kv_cache_manager
from minivllm.core.kv_cache_manager import Block
from minivllm.core.model_runner import StepInputs
from minivllm.core.sequence import Sequence


def _not_written_02_1(method: str) -> NotImplementedError:
    return NotImplementedError(f"exercise 02.1 ({method}) is not written yet: fill it in, "
                               "chapters/exercises/ex02_paged_kv_cache.py; read chapters/02_paged_kv_cache.md, "
                               "'From block table to slot'")


def _slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
    """Exercise 02.1: the cache slot of each of `seq`'s positions start .. end-1 (chapter 02, "From block
    table to slot"). Replaces ModelRunner._slots.

    The KV cache is [num_blocks, block_size, ...]: its slots number those rows block after block.
    Position p of a sequence is at offset p % block_size of its logical block p // block_size,
    which seq.block_table maps to a physical block. Returns [end - start] integers (any int dtype;
    the callers cast), in position order. 0 <= start < end <= len(seq.block_table) * block_size.
    """
    raise _not_written_02_1("_slots")


def _block_tables(self, seqs: list[Sequence]) -> np.ndarray:
    """Exercise 02.1: the block tables of a step's sequences as one array (chapter 02, "From block
    table to slot"). Replaces ModelRunner._block_tables.

    Returns [len(seqs), self.max_num_blocks_per_seq] int32: row i is seqs[i].block_table, then zeros.
    One width for every step, however short the tables: a Triton kernel is compiled per row stride.
    """
    raise _not_written_02_1("_block_tables")


def prepare_prefill(self, seqs: list[Sequence], num_scheduled_tokens: list[int], num_decodes: int = 0,
                    use_cache: bool = True) -> StepInputs:
    """Exercise 02.1: pack one step's tokens back to back, with the cache slot of each, for the model
    and the attention kernels (chapter 02, "From block table to slot"). Replaces ModelRunner.prepare_prefill.

    seqs[i] computes num_scheduled_tokens[i] tokens in this step, the ones that end at
    seqs[i].num_computed_tokens (the scheduler has counted them already): positions
    [num_computed_tokens - n, num_computed_tokens) of seq.token_ids. The first `num_decodes` sequences
    are decode rows (one token each, their context in the cache); they are packed like the others.
    Every token's K/V is written to its slot (self._slots). use_cache=False (a warm-up forward)
    stores nothing: every slot is -1. Read only seq.token_ids, seq.num_computed_tokens,
    seq.num_tokens and seq.block_table (speculative decoding, chapter 15, passes stand-ins that have
    only these).

        seqs A (7 tokens, all new) and B (10, the first 6 cached): the step's tokens, back to back
        rows:          0  1  2  3  4  5  6 | 7  8  9 10
        positions:     0  1  2  3  4  5  6 | 6  7  8  9
        cu_seqlens_q: [0, 7, 11]    cu_seqlens_k: [0, 7, 17]    (new tokens / all tokens, cumulative)

    Returns StepInputs (minivllm/core/model_runner.py) with, as numpy arrays of these dtypes:
      input_ids [num_tokens] int64, positions [num_tokens] int64, slot_mapping [num_tokens] int32;
      logits_indices int64: the row of the last token of each sequence whose step reaches its last
        token (it samples), in batch order; a prompt chunk that stops short samples nothing (given:
        self._logits_indices(seqs, cu_seqlens_q) computes them);
      block_tables: self._block_tables(seqs);
      cu_seqlens_q, cu_seqlens_k [len(seqs) + 1] int32;
    and is_prefill=True, max_seqlen_q / max_seqlen_k (ints: the longest new / whole length),
    has_prefix (some sequence's step starts after position 0), num_decodes.
    """
    raise _not_written_02_1("prepare_prefill")


def prepare_decode(self, seqs: list[Sequence]) -> StepInputs:
    """Exercise 02.1: a decode step's inputs, one new token per sequence (chapter 02, "From block table
    to slot"). Replaces ModelRunner.prepare_decode.

    Sequence i's new token is its last, seq.last_token, at position seq.num_tokens - 1; its K/V goes
    to that position's slot, and attention reads the sequence's seq.num_tokens keys (the new one
    included) through its block table. Read only seq.last_token, seq.num_tokens and seq.block_table
    (speculative decoding passes stand-ins that have only these).

    Returns StepInputs with, as numpy arrays of these dtypes:
      input_ids [n] int64, positions [n] int64, slot_mapping [n] int32;
      logits_indices [n] int64: every row samples, 0 .. n-1;
      block_tables: self._block_tables(seqs);
      context_lens [n] int32: each sequence's seq.num_tokens;
      seq_order [n] int32: the rows by context length, longest first, ties in row order (chapter 06's
        kernel starts the longest first);
    and is_prefill=False, num_decodes=n (the other fields keep their defaults).
    """
    raise _not_written_02_1("prepare_decode")


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
