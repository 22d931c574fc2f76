"""A request as the engine sees it: its token ids, where its KV lives, and how far it has got.

A Sequence is plain Python (no tensors), so the scheduler and the KV cache manager can be tested
alone. vLLM: vllm/v1/request.py (Request); nano-vllm: nanovllm/engine/sequence.py.
"""
from enum import Enum, auto
from itertools import count

from minivllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()  # queued for prefill (new, or preempted and waiting to be recomputed)
    RUNNING = auto()  # holds KV blocks: prefilling (chunk by chunk) or decoding
    FINISHED = auto()


class Sequence:
    """Token ids of one request plus its KV-cache bookkeeping.

        token_ids:    | prompt ............ | completion ...... |
                       <- num_prompt_tokens -><- num_completion_tokens ->
        block_table:  [ b7 ][ b2 ][ b9 ]      one KV block per block_size tokens
                       <- num_cached_tokens ->   (prefix-cache hits; not recomputed)
                       <---- num_computed_tokens ---->   (KV written, or being written by the
                                                          step just scheduled)

    A prefill may take several steps (chunked prefill): each step computes the next chunk of
    `num_tokens - num_computed_tokens` tokens. A decoding sequence is one token behind: its last
    token was sampled and its KV is written by the next step.
    """

    _counter = count()  # seq_id source; ids only need to be unique within a process

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams | None = None, block_size: int = 16):
        if not token_ids:
            raise ValueError("a Sequence needs at least one token")
        self.seq_id = next(Sequence._counter)
        self.status = SequenceStatus.WAITING
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.block_size = block_size
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_cached_tokens = 0  # tokens whose KV came from the prefix cache when it was admitted
        self.num_computed_tokens = 0  # tokens whose KV is in the cache (the scheduled step's included)
        self.num_prompt_cached_tokens: int | None = None  # hits at the first admission (reported per request)
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hash of each full block, filled by the KV cache manager
        self.finish_reason: str | None = None  # "stop", "length" or "abort"
        self.stop_reason: int | str | None = None  # the stop token id (or stop string) that ended it

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, status={self.status.name}, num_tokens={self.num_tokens}, "
                f"num_cached_tokens={self.num_cached_tokens}, num_computed_tokens={self.num_computed_tokens}, "
                f"block_table={self.block_table})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens the next steps must still compute: 1 for a decoding sequence, more mid-prefill."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_uncomputed_tokens > 1

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_completion_tokens(self) -> int:
        # Also the sampling step counter: a seeded request derives step i's noise from (seed, i).
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_blocks(self) -> int:
        """Blocks needed to hold the KV of every token so far."""
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Its prompt's logprobs are still to be computed: every prompt position needs its logits,
        so none may come from the prefix cache (at the first prefill, not after a preemption)."""
        return self.sampling_params.prompt_logprobs is not None and self.num_completion_tokens == 0

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
