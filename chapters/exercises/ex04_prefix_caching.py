"""Chapter 04 exercises: prefix caching in the KV cache manager (minivllm/core/kv_cache_manager.py).
Write each function's body; `make exercise CH=04` runs the KV cache manager's tests with them.

`allocate_slots` replaces the method KVCacheManager.allocate_slots: `self` is the manager, with
every attribute the core's has (use its block pool, `self.pool`: block, touch, allocate).
"""
from minivllm.core.sequence import Sequence


def compute_block_hashes(prev_hash: bytes | None, token_ids: list[int], block_size: int) -> list[bytes]:
    """Exercise 04.1: the chained hashes of the consecutive full blocks of `token_ids`
    (chapter 04, "Chained block hashes").

    Block i's hash is sha256(previous block's hash + block i's token ids as little-endian int64
    bytes).digest(); the first block's previous hash is `prev_hash`, or b"" when it is None. A
    partial last block (fewer than block_size tokens) gets no hash. Because each hash covers the
    one before it, a hash names the whole prefix up to and including its block.
    Useful: hashlib.sha256(data).digest(); array.array("q", ids).tobytes() (native order,
    little-endian on every machine this runs on) or int.to_bytes(8, "little", signed=True).
    """
    raise NotImplementedError("exercise 04.1 (compute_block_hashes) is not written yet: fill it in, "
                              "chapters/exercises/ex04_prefix_caching.py; read chapters/04_prefix_caching.md, "
                              "'Chained block hashes'")


def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed=None) -> bool:
    """Exercise 04.2: room for the KV of `seq`'s next `num_new_tokens` tokens, reusing the cached
    prefix `computed` at an admission (chapter 04, "Freed blocks keep their hash; LRU recycling"
    and "Never the last prompt token"). Replaces KVCacheManager.allocate_slots.

    computed: a ComputedBlocks (block_ids, num_tokens) from self.get_computed_blocks, or None (none).
    1. The block table must cover seq.num_computed_tokens + computed.num_tokens + num_new_tokens
       tokens: count the new blocks that takes beyond the table and the computed blocks.
    2. A computed block with ref_count 0 (self.pool.block(id).ref_count) sits in the free queue:
       taking it costs a free block too. If the new blocks plus those exceed self.num_free_blocks,
       return False and change nothing.
    3. An admission (the block table is empty): count self.num_prompt_tokens_queried +=
       seq.num_tokens and self.num_cached_tokens_hit += computed.num_tokens, and set
       self.num_registered_blocks[seq.seq_id] to the number of computed blocks (they are registered).
    4. self.pool.touch(id) for each computed block (a reference), append them to the block table,
       then self.pool.allocate() for each new block (it recycles the least recently freed block,
       which forgets its hash). Return True.
    Register no hash here: a block becomes findable once the step that writes it is scheduled.
    """
    raise NotImplementedError("exercise 04.2 (allocate_slots) is not written yet: fill it in, "
                              "chapters/exercises/ex04_prefix_caching.py; read chapters/04_prefix_caching.md, "
                              "'Freed blocks keep their hash; LRU recycling'")
