"""Chapter 04 exercises: prefix caching in the block manager (minivllm/engine/block_manager.py).
Write each function's body; `make exercise CH=04` runs the block manager's tests with them.

`allocate` replaces the method BlockManager.allocate: `self` is the block manager, with every
attribute and helper the engine's has (use them: `self._find_cached_blocks`, `self._take_block`,
`self._allocate_new_block`).
"""
from minivllm.engine.sequence import Sequence


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


def allocate(self, seq: Sequence) -> None:
    """Exercise 04.2: give `seq` a block table for all its tokens, reusing cached prefix blocks
    (chapter 04, "Freed blocks keep their hash; LRU recycling" and "Never the last prompt token").

    1. cached = self._find_cached_blocks(seq): the physical ids of the longest cached prefix.
       Take a reference to each (self._take_block(id): ref_count + 1, and out of the free queue if
       it was free there). They start the block table.
    2. seq.num_cached_tokens and seq.num_computed_tokens = tokens in those blocks. The first time
       a sequence is allocated (seq.num_prompt_cached_tokens is None) also set
       seq.num_prompt_cached_tokens to it; a preempted sequence keeps its first value.
    3. Fresh blocks for the rest, up to seq.num_blocks: self._allocate_new_block() (it recycles the
       least recently freed block, which forgets its hash).
    4. Statistics: self.num_prompt_tokens_queried += seq.num_tokens and
       self.num_cached_tokens_hit += the cached tokens.
    Register no hash here: a block becomes findable once the step that writes it is scheduled.
    """
    raise NotImplementedError("exercise 04.2 (allocate) is not written yet: fill it in, "
                              "chapters/exercises/ex04_prefix_caching.py; read chapters/04_prefix_caching.md, "
                              "'Freed blocks keep their hash; LRU recycling'")
