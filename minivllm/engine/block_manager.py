"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, a free queue, and prefix caching.

The block manager only hands out block ids; the ModelRunner owns the KV tensors they index.
vLLM: vllm/v1/core/block_pool.py and kv_cache_manager.py; nano-vllm: nanovllm/engine/block_manager.py.
"""
import hashlib
from array import array
from collections import OrderedDict

from minivllm.engine.sequence import Sequence


def compute_block_hash(prev_hash: bytes | None, token_ids: list[int]) -> bytes:
    """sha256 over the previous block's hash and this block's token ids (int64).

    Chaining makes one hash name the whole prefix up to and including this block, so two prompts
    share block i only if all their tokens up to block i agree. A cryptographic hash makes a
    collision (which would silently give wrong attention) practically impossible.
    """
    return compute_block_hashes(prev_hash, token_ids, len(token_ids))[0]


def compute_block_hashes(prev_hash: bytes | None, token_ids: list[int], block_size: int) -> list[bytes]:
    """The chained hashes of consecutive full blocks of `token_ids` (one conversion to bytes for all)."""
    data, width, hashes = array("q", token_ids).tobytes(), 8 * block_size, []
    for start in range(0, len(token_ids) // block_size * width, width):
        prev_hash = hashlib.sha256((prev_hash or b"") + data[start:start + width]).digest()
        hashes.append(prev_hash)
    return hashes


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None  # chained hash once the block is full (prefix caching on)

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref_count={self.ref_count}, hashed={self.hash is not None})"


class FreeBlockQueue:
    """The free block ids in the order they will be reused: an ordered set with OrderedDict's
    interface (`q[id] = None` appends, `del q[id]`, `q.popitem(last=False)` takes the first).

    Ids never used yet come first, in order, and are not stored: an engine with millions of blocks
    (a small model on a large GPU) starts at once instead of building millions of entries. They
    always precede the freed ones: the queue starts as 0..n-1 and freed blocks join at its end.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.next_unused = 0  # ids next_unused..num_blocks-1 were never handed out
        self.freed: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return self.num_blocks - self.next_unused + len(self.freed)

    def __iter__(self):
        yield from range(self.next_unused, self.num_blocks)
        yield from self.freed

    def __contains__(self, block_id: int) -> bool:
        return self.next_unused <= block_id < self.num_blocks or block_id in self.freed

    def __setitem__(self, block_id: int, _value: None) -> None:
        assert block_id < self.next_unused, f"block {block_id} was never handed out"
        self.freed[block_id] = None

    def __delitem__(self, block_id: int) -> None:
        del self.freed[block_id]  # a block taken back from the queue was used before (it has a hash)

    def popitem(self, last: bool = True) -> tuple[int, None]:
        assert not last, "blocks are reused first in, first out"
        if self.next_unused < self.num_blocks:
            self.next_unused += 1
            return self.next_unused - 1, None
        return self.freed.popitem(last=False)


class Blocks:
    """blocks[i] is block i's Block, made the first time it is asked for (see FreeBlockQueue)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.made: dict[int, Block] = {}

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, block_id: int) -> Block:
        block = self.made.get(block_id)
        if block is None:
            if not 0 <= block_id < self.num_blocks:
                raise IndexError(f"block id {block_id} out of range (0..{self.num_blocks - 1})")
            block = self.made[block_id] = Block(block_id)
        return block

    def __iter__(self):
        return (self[i] for i in range(self.num_blocks))


class BlockManager:
    """Allocates KV blocks to sequences and shares full blocks between equal prefixes.

        blocks:           [ b0 ref=2 #A ][ b1 ref=1 #B ][ b2 ref=0 #C ][ b3 ref=0 ][ b4 ref=1 ]
        hash_to_block_id: {#A: 0, #B: 1, #C: 2}      full blocks, findable by prefix hash
        free_block_ids:   b3 -> b2                   ref_count 0, least recently freed first
                          (b2 still holds #C's KV: a later prompt with that prefix takes it back
                           out of the queue; allocating a new block recycles b3 first, and a
                           recycled block drops its hash)
        seq.block_table:  [0, 1, 4]                  logical block i -> physical block id

    `num_free_blocks` counts every block with ref_count 0, cached or not.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = Blocks(num_blocks)
        self.free_block_ids = FreeBlockQueue(num_blocks)  # an ordered set, least recently freed first
        self.hash_to_block_id: dict[bytes, int] = {}
        self._hash_table_version = 0  # bumped whenever hash_to_block_id changes (see _find_cached_blocks)
        self._last_lookup = None  # ((seq_id, num_tokens, version), cached block ids) of the last lookup
        self.num_prompt_tokens_queried = 0  # tokens of every allocated prompt (re-prefills included)
        self.num_cached_tokens_hit = 0  # of those, tokens served from the prefix cache

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_cached_tokens_hit / max(self.num_prompt_tokens_queried, 1)

    # -- prefill -------------------------------------------------------------------------------

    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        # Tokens only ever get appended, so a full block's hash never changes: memoize on the seq.
        hashes, bs = seq.block_hashes, self.block_size
        if len(hashes) < num_full_blocks:
            hashes += compute_block_hashes(hashes[-1] if hashes else None,
                                           seq.token_ids[len(hashes) * bs:num_full_blocks * bs], bs)
        return hashes[:num_full_blocks]

    def _find_cached_blocks(self, seq: Sequence) -> list[int]:
        """Physical ids of the longest cached prefix of `seq`, in whole blocks.

        Only blocks that end before the last token count: the last token must be computed to get
        the logits of the next one, so a prompt that is entirely cached recomputes its last block.
        """
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:  # (those need every position's logits)
            return []
        # The scheduler asks three times per admitted prompt (get_num_cached_tokens, can_allocate,
        # allocate): remember the answer until the sequence or the hash table changes.
        key = (seq.seq_id, seq.num_tokens, self._hash_table_version)
        if self._last_lookup is not None and self._last_lookup[0] == key:
            return list(self._last_lookup[1])
        num_lookup_blocks = (seq.num_tokens - 1) // self.block_size
        cached = []
        for h in self._block_hashes(seq, num_lookup_blocks):
            block_id = self.hash_to_block_id.get(h)
            if block_id is None:
                break
            cached.append(block_id)
        self._last_lookup = (key, cached)
        return list(cached)

    def get_num_cached_tokens(self, seq: Sequence) -> int:
        """Tokens of `seq` that `allocate` would take from the prefix cache now (no side effects)."""
        return len(self._find_cached_blocks(seq)) * self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        # A hit on a block some running sequence holds costs nothing; a hit on a free cached block
        # takes that block out of the free queue, just like a fresh block.
        cached = self._find_cached_blocks(seq)
        num_shared = sum(1 for b in cached if self.blocks[b].ref_count > 0)
        return self.num_free_blocks >= seq.num_blocks - num_shared

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` a block table for all its tokens, reusing cached prefix blocks.

        Sets seq.num_cached_tokens (a multiple of block_size, always < seq.num_tokens) and
        seq.num_computed_tokens to it, and at the first allocation seq.num_prompt_cached_tokens,
        which `deallocate` keeps for reporting. No new block is registered here: a block becomes
        findable (`commit_blocks`) only once the step that writes its KV is scheduled.
        """
        assert not seq.block_table, f"seq {seq.seq_id} already has blocks"
        cached = self._find_cached_blocks(seq)
        for block_id in cached:
            self._take_block(block_id)
        seq.block_table = list(cached)
        seq.num_cached_tokens = seq.num_computed_tokens = len(cached) * self.block_size
        if seq.num_prompt_cached_tokens is None:  # kept across preemption and after finishing
            seq.num_prompt_cached_tokens = seq.num_cached_tokens
        for _ in range(len(cached), seq.num_blocks):
            seq.block_table.append(self._allocate_new_block())
        self.num_prompt_tokens_queried += seq.num_tokens
        self.num_cached_tokens_hit += seq.num_cached_tokens

    def commit_blocks(self, seq: Sequence, start: int, end: int) -> None:
        """Register the blocks that the tokens [start, end) of a scheduled prefill chunk fill.

            tokens:  |.... block 0 ....|.... block 1 ....|.... block 2 ....|
            chunk:            [start ..................... end)
            registered now:             block 1 (full by end); block 0 was filled by an earlier
                                        chunk; block 2 waits for the next chunk

        The step that computes the chunk writes each token's K/V into the cache before attention
        reads the cache, layer by layer, so a later sequence in the same step or any later step may
        already hit these blocks; blocks the chunk does not fill stay unregistered until a chunk does.
        """
        if not self.enable_prefix_caching:
            return
        first, last = start // self.block_size, end // self.block_size  # blocks full by `end`: [.., last)
        if first < last:
            hashes = self._block_hashes(seq, last)
            for i in range(first, last):
                self._register_hash(seq.block_table[i], hashes[i])

    # -- decode --------------------------------------------------------------------------------

    def can_append(self, seq: Sequence) -> bool:
        """Is there room for the KV of seq's last token (it opens a new block every block_size)?"""
        return self.num_free_blocks >= self._needs_new_block(seq)

    def may_append(self, seq: Sequence) -> None:
        """Make room for the KV of seq's last token, which this decode step writes.

        Opens a new block when the last token starts one; when the last token fills its block,
        registers the block's hash so later prompts can hit blocks produced by decoding too.
        """
        self.append_slot(seq)
        self.commit_full_block(seq)

    def append_slot(self, seq: Sequence) -> None:
        """Open a new block when seq's last token starts one: `may_append` without registering the
        block. (Async scheduling, async_scheduling.py, schedules a decode before its last token is
        known and registers the block with `commit_full_block` once it is.)"""
        if self._needs_new_block(seq):
            seq.block_table.append(self._allocate_new_block())

    def commit_full_block(self, seq: Sequence) -> None:
        """Register the hash of seq's last block if its last token just filled it."""
        if self.enable_prefix_caching and seq.num_tokens % self.block_size == 0:
            i = seq.num_blocks - 1
            self._register_hash(seq.block_table[i], self._block_hashes(seq, i + 1)[i])

    def _needs_new_block(self, seq: Sequence) -> bool:
        return len(seq.block_table) < seq.num_blocks

    # -- freeing -------------------------------------------------------------------------------

    def deallocate(self, seq: Sequence) -> None:
        """Drop seq's references; blocks that reach ref_count 0 join the free queue (keeping their
        hash). The tail is freed first so that it is recycled before the more shareable prefix."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_cached_tokens = seq.num_computed_tokens = 0

    def uncache_blocks(self, seq: Sequence) -> None:
        """Take seq's blocks out of the prefix cache; they stay allocated to seq.

        For a step that failed (an exception, Ctrl-C, out of memory): `commit_blocks` and
        `commit_full_block` register a block's hash when its KV is scheduled to be written, so
        after a failed step some registered blocks may hold KV that was never written. Every
        block the failed step could have written belongs to a running sequence; the engine calls
        this for each of them before freeing them, and no later prompt can hit those blocks.
        """
        for block_id in seq.block_table:
            self._unregister_hash(block_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache), e.g. between benchmark runs.
        Refused (False) while any block is in use: running sequences' blocks stay registered."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self.hash_to_block_id.clear()
        self._hash_table_version += 1
        for block in self.blocks.made.values():  # the blocks ever used (the others have no hash)
            block.hash = None
        return True

    # -- helpers -------------------------------------------------------------------------------

    def _take_block(self, block_id: int) -> None:
        """Add a reference to a cached block (taking it off the free queue if it was free)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
        block.ref_count += 1

    def _allocate_new_block(self) -> int:
        """Recycle the least recently freed block; it forgets the prefix it cached."""
        assert self.free_block_ids, "no free KV blocks: check can_allocate / can_append first"
        block_id, _ = self.free_block_ids.popitem(last=False)
        self._unregister_hash(block_id)
        self.blocks[block_id].ref_count = 1
        return block_id

    def _register_hash(self, block_id: int, block_hash: bytes) -> None:
        # The block remembers its hash so that recycling it can drop the table entry; the table keeps
        # the first block that cached this prefix (a recomputed last block is a duplicate).
        self.blocks[block_id].hash = block_hash
        if self.hash_to_block_id.setdefault(block_hash, block_id) == block_id:
            self._hash_table_version += 1

    def _unregister_hash(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
            self._hash_table_version += 1
        block.hash = None
