"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, a free queue, prefix caching.

The manager only hands out block ids; the ModelRunner owns the KV tensors they index.
vLLM: vllm/v1/core/kv_cache_manager.py and block_pool.py; nano-vllm: nanovllm/engine/block_manager.py.
"""
import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from minivllm.core.sequence import Sequence


def compute_block_hashes(prev_hash: bytes | None, token_ids: list[int], block_size: int) -> list[bytes]:
    """The chained hashes of the consecutive full blocks of `token_ids`: sha256 over the previous
    block's hash and this block's token ids (int64).

    Chaining makes one hash name the whole prefix up to and including a block, so two prompts share
    block i only if all their tokens up to block i agree. A cryptographic hash makes a collision
    (which would silently give wrong attention) practically impossible."""
    data, width, hashes = array("q", token_ids).tobytes(), 8 * block_size, []
    for start in range(0, len(token_ids) // block_size * width, width):
        prev_hash = hashlib.sha256((prev_hash or b"") + data[start:start + width]).digest()
        hashes.append(prev_hash)
    return hashes


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None  # chained hash once the block is full and registered

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref_count={self.ref_count}, hashed={self.hash is not None})"


class BlockPool:
    """Every block, the free queue and the hash table of full blocks.

    The free queue lists free block ids in the order they will be reused: ids never used yet first,
    in order (not stored: an engine with millions of blocks starts at once), then freed ones, least
    recently freed first. Block objects are made the first time a block is used.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.next_unused = 0  # ids next_unused .. num_blocks-1 were never handed out
        self.freed: OrderedDict[int, None] = OrderedDict()  # an ordered set
        self.blocks: dict[int, Block] = {}
        self.hash_to_block_id: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.next_unused + len(self.freed)

    def block(self, block_id: int) -> Block:
        if block_id not in self.blocks:
            if not 0 <= block_id < self.num_blocks:
                raise IndexError(f"block id {block_id} out of range (0..{self.num_blocks - 1})")
            self.blocks[block_id] = Block(block_id)
        return self.blocks[block_id]

    def free_block_ids(self) -> list[int]:
        """The free queue, first to be reused first."""
        return list(range(self.next_unused, self.num_blocks)) + list(self.freed)

    def allocate(self) -> int:
        """Recycle the first block of the free queue; it forgets the prefix it cached."""
        assert self.num_free_blocks, "no free KV blocks: check allocate_slots' answer first"
        if self.next_unused < self.num_blocks:
            self.next_unused += 1
            block_id = self.next_unused - 1
        else:
            block_id, _ = self.freed.popitem(last=False)
        self.unregister(block_id)
        self.block(block_id).ref_count = 1
        return block_id

    def touch(self, block_id: int) -> None:
        """One more reference to a cached block (taken off the free queue if it was free)."""
        block = self.block(block_id)
        if block.ref_count == 0:
            del self.freed[block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        """One reference less; at 0 the block joins the end of the free queue, keeping its hash."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0
        if block.ref_count == 0:
            self.freed[block_id] = None

    def register(self, block_id: int, block_hash: bytes) -> None:
        # The table keeps the first block that cached a prefix (a recomputed last block is a duplicate);
        # the block remembers its hash, so that recycling it can drop its entry.
        self.block(block_id).hash = block_hash
        self.hash_to_block_id.setdefault(block_hash, block_id)

    def unregister(self, block_id: int) -> None:
        block = self.block(block_id)
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.hash = None


@dataclass
class ComputedBlocks:
    """The cached prefix of a waiting sequence (get_computed_blocks)."""

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0  # len(block_ids) * block_size


class KVCacheManager:
    """Allocates KV blocks to sequences and shares full blocks between equal prefixes.

        blocks:           [ b0 ref=2 #A ][ b1 ref=1 #B ][ b2 ref=0 #C ][ b3 ref=0 ][ b4 ref=1 ]
        hash_to_block_id: {#A: 0, #B: 1, #C: 2}      full blocks, findable by prefix hash
        free queue:       b3 -> b2                   ref_count 0, least recently freed first
                          (b2 still holds #C's KV: a prompt with that prefix takes it back out of
                           the queue; a new block recycles b3 first, and a recycled block drops
                           its hash)
        seq.block_table:  [0, 1, 4]                  logical block i -> physical block id

    One admission:  computed = get_computed_blocks(seq); allocate_slots(seq, n, computed)
    Every step:     allocate_slots(seq, num_new_tokens); cache_blocks(seq, num_computed_tokens)
    The end:        free(seq)
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.num_registered_blocks: dict[int, int] = {}  # seq_id -> its leading blocks in the hash table
        self.num_prompt_tokens_queried = 0  # tokens of every admitted prompt (re-prefills included)
        self.num_cached_tokens_hit = 0  # of those, tokens served from the prefix cache

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """The fraction of blocks in use (vLLM's kv_cache_usage)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        # Tokens only ever get appended, so a full block's hash never changes: memoized on the seq.
        hashes, bs = seq.block_hashes, self.block_size
        if len(hashes) < num_full_blocks:
            hashes += compute_block_hashes(hashes[-1] if hashes else None,
                                           seq.token_ids[len(hashes) * bs:num_full_blocks * bs], bs)
        return hashes[:num_full_blocks]

    def get_computed_blocks(self, seq: Sequence) -> ComputedBlocks:
        """The longest cached prefix of a waiting `seq`, in whole blocks (no side effects).

        Only blocks that end before the last token count: its logits are needed, so a prompt that
        is entirely cached recomputes its last block."""
        if not self.enable_prefix_caching or seq.skip_reading_prefix_cache:
            return ComputedBlocks()
        block_ids = []
        for h in self._block_hashes(seq, (seq.num_tokens - 1) // self.block_size):
            block_id = self.pool.hash_to_block_id.get(h)
            if block_id is None:
                break
            block_ids.append(block_id)
        return ComputedBlocks(block_ids, len(block_ids) * self.block_size)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed: ComputedBlocks | None = None) -> bool:
        """Room for the KV of `seq`'s next `num_new_tokens` tokens, after its computed ones and the
        cached prefix `computed` (an admission). False, with nothing changed, when blocks are short.

        A hit on a block that a running sequence holds costs nothing; a hit on a free cached block
        takes it out of the free queue, as a new block would."""
        computed = computed or ComputedBlocks()
        num_tokens = seq.num_computed_tokens + computed.num_tokens + num_new_tokens
        num_new_blocks = -(-num_tokens // self.block_size) - len(seq.block_table) - len(computed.block_ids)
        num_revived = sum(self.pool.block(b).ref_count == 0 for b in computed.block_ids)
        if max(num_new_blocks, 0) + num_revived > self.num_free_blocks:
            return False
        if not seq.block_table:  # an admission: count its prefix-cache lookup
            self.num_prompt_tokens_queried += seq.num_tokens
            self.num_cached_tokens_hit += computed.num_tokens
            self.num_registered_blocks[seq.seq_id] = len(computed.block_ids)
        for block_id in computed.block_ids:
            self.pool.touch(block_id)
        seq.block_table += computed.block_ids
        seq.block_table += [self.pool.allocate() for _ in range(num_new_blocks)]
        return True

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks that `seq`'s first `num_tokens` tokens fill, so that later prompts
        can hit them. The step that computes them writes their K/V before attention reads the
        cache, layer by layer: a later sequence of the same step may already hit them."""
        first = self.num_registered_blocks.get(seq.seq_id, 0)
        last = num_tokens // self.block_size
        if not self.enable_prefix_caching or last <= first:
            return
        hashes = self._block_hashes(seq, last)
        for i in range(first, last):
            self.pool.register(seq.block_table[i], hashes[i])
        self.num_registered_blocks[seq.seq_id] = last

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; blocks that reach 0 join the free queue, keeping their hash. The
        tail goes first, so that it is recycled before the more shareable prefix."""
        for block_id in reversed(seq.block_table):
            self.pool.release(block_id)
        seq.block_table = []
        self.num_registered_blocks.pop(seq.seq_id, None)

    def uncache_blocks(self, seq: Sequence) -> None:
        """Take seq's blocks out of the prefix cache (they stay allocated): after a step that
        failed part-way, registered blocks may hold K/V that was never written."""
        for block_id in seq.block_table:
            self.pool.unregister(block_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache). Refused (False) while any block
        is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self.pool.hash_to_block_id.clear()
        for block in self.pool.blocks.values():
            block.hash = None
        return True
