"""Which sequences run in the next step: continuous batching under a token budget per step, and
preemption by recompute when KV blocks run out.

Without chunked prefill (chapter 03) a step is either a prefill of whole prompts or a decode of
every running sequence, as in nano-vllm. Later, chunked prefill (chapter 11, the engine's default)
mixes decodes (one token each) with prompt chunks in one step: running decodes first, then the
next chunk of a prompt part-way through its prefill, then new prompts, until the step's token
budget (`max_num_batched_tokens`) is spent; a prompt longer than what is left is split across steps.
vLLM: vllm/v1/core/sched/scheduler.py.
"""
from collections import deque
from dataclasses import dataclass

from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.sequence import Sequence, SequenceStatus

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class SchedulerOutput:
    """The sequences of one step and what the step computes.

        seqs:                  [ d0 ][ d1 ][ d2 ][ p0 ............ ][ p1 ...... ]
        num_scheduled_tokens:    1     1     1    chunk of p0         chunk of p1
                                <- num_decodes ->
        sampled_seqs:          the sequences whose step reaches their last token (every decode,
                               and a prompt whose last chunk this is): they get a new token

    A chunk ends at seq.num_computed_tokens: the scheduler has already counted the step's tokens.
    """

    seqs: list[Sequence]  # decodes first, then prefill chunks
    num_scheduled_tokens: list[int]  # per sequence: 1 for a decode, the chunk length for a prefill
    num_decodes: int
    sampled_seqs: list[Sequence]
    num_cached_tokens: int = 0  # prompt tokens of newly admitted sequences served from the prefix cache

    @classmethod
    def decodes(cls, seqs: list[Sequence]) -> "SchedulerOutput":
        return cls(list(seqs), [1] * len(seqs), len(seqs), list(seqs))

    @property
    def is_prefill(self) -> bool:
        """Does the step compute prompt tokens (a prefill or a mixed step)? Else: decode only."""
        return len(self.seqs) > self.num_decodes

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.num_scheduled_tokens[self.num_decodes:])

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)


class Scheduler:
    """Owns the waiting and running queues and the KVCacheManager.

        waiting: deque[Sequence]  new prompts at the back, preempted sequences at the front
        running: deque[Sequence]  admission order: the newest is preempted first

    One step:  schedule() -> the model runs it -> update_from_output(out, token_ids)

    A chunked step, max_num_batched_tokens = 16, three decodes and a 20-token prompt waiting:

        step 1: | d0 | d1 | d2 |  p[0:13] ...................... |   p is part-prefilled
        step 2: | d0 | d1 | d2 |  p[13:20] ....... | free         |   p samples its first token
        step 3: | d0 | d1 | d2 | p  | free .........................|
    """

    def __init__(self, config):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.eos_token_id = config.eos_token_id
        self.block_size = config.kvcache_block_size
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunked prefill a sequence of max_model_len tokens must fit one step.
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                             f"max_model_len={self.max_model_len} when chunked prefill is off")
        self.kv_cache_manager = KVCacheManager(config.num_kvcache_blocks, self.block_size,
                                               config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; reject one that could never be scheduled.

        Raises:
            ValueError: the prompt is longer than max_model_len, or the sequence at its longest
                (prompt + max_tokens, capped by max_model_len) needs more KV blocks than exist.
        """
        assert seq.status == SequenceStatus.WAITING and not seq.block_table
        if seq.num_tokens > self.max_model_len:
            raise ValueError(f"prompt has {seq.num_tokens} tokens, more than max_model_len={self.max_model_len}")
        # The last sampled token is never written to the cache, hence the - 1.
        max_len = min(seq.num_prompt_tokens + seq.sampling_params.max_tokens, self.max_model_len)
        num_blocks_needed = -(-max(seq.num_tokens, max_len - 1) // self.block_size)
        if num_blocks_needed > self.kv_cache_manager.num_blocks:
            raise ValueError(
                f"sequence {seq.seq_id} may need {num_blocks_needed} KV blocks (prompt {seq.num_prompt_tokens} + "
                f"max_tokens {seq.sampling_params.max_tokens} tokens, block size {self.block_size}) but the cache "
                f"has only {self.kv_cache_manager.num_blocks}; raise num_kvcache_blocks or lower max_tokens")
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> SchedulerOutput:
        """Pick the next step. Chunked prefill: running decodes first, then prompt chunks fill the
        rest of the token budget. Otherwise: a prefill if any waiting sequence fits now, else a decode."""
        if not self.enable_chunked_prefill:
            output = self.schedule_prefills()
            if not output.seqs:
                output = SchedulerOutput.decodes(self._schedule_decodes())
        else:
            num_preemptions = self.num_preemptions
            decodes = self._schedule_decodes()
            # After a preemption blocks are short: admit nothing new this step (it would be preempted next).
            admit = self.num_preemptions == num_preemptions
            output = self._schedule_chunks(self.max_num_batched_tokens - len(decodes), decodes, admit)
        assert output.seqs, "nothing to schedule: call schedule() only while not is_finished()"
        return output

    def schedule_prefills(self) -> SchedulerOutput:
        """Prompt chunks only (no decodes) within the token budget: the next chunk of part-prefilled
        sequences, then waiting ones admitted in order while seats, budget and blocks allow (no
        seqs: nothing fits now). Tokens served from the prefix cache cost no budget.

            max_num_batched_tokens: |== seq A uncached ==|== seq B uncached ==|... free ...|
        """
        return self._schedule_chunks(self.max_num_batched_tokens, [], admit=True)

    def _schedule_chunks(self, budget: int, decodes: list[Sequence], admit: bool) -> SchedulerOutput:
        """Fill `budget` tokens with prompt chunks, after the step's `decodes` (already scheduled)."""
        seqs, num_tokens = list(decodes), [1] * len(decodes)
        for seq in [s for s in self.running if s.is_prefilling]:  # part-prefilled first, oldest first
            if budget == 0:
                break
            num_tokens.append(self._schedule_chunk(seq, min(seq.num_uncomputed_tokens, budget)))
            seqs.append(seq)
            budget -= num_tokens[-1]
        admitted = self._schedule_waiting(budget) if admit else []
        seqs += admitted
        num_tokens += [seq.num_computed_tokens - seq.num_cached_tokens for seq in admitted]  # their first chunks
        sampled = [seq for seq in seqs if seq.num_computed_tokens == seq.num_tokens]
        return SchedulerOutput(seqs, num_tokens, len(decodes), sampled, sum(seq.num_cached_tokens for seq in admitted))

    def _schedule_waiting(self, budget: int) -> list[Sequence]:
        """Admit sequences from the front of waiting, in order, while a seat, `budget` tokens and KV
        blocks allow: each moves to running with blocks for its whole prompt, its cached prefix taken
        from the prefix cache, and its first chunk scheduled. Returns them, in order.

            waiting: [ A ][ B ][ C ] ...    A's uncached tokens, then B's, ... within the budget;
                                           the first that does not fit stops admission (FCFS)
        """
        admitted = []
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            computed = self.kv_cache_manager.get_computed_blocks(seq)
            num_new_tokens = seq.num_tokens - computed.num_tokens
            if num_new_tokens > budget and not self.enable_chunked_prefill:
                break
            if not self.kv_cache_manager.allocate_slots(seq, num_new_tokens, computed):
                break
            seq.num_cached_tokens = seq.num_computed_tokens = computed.num_tokens
            if seq.num_prompt_cached_tokens is None:  # kept across preemption, for the request's output
                seq.num_prompt_cached_tokens = seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            budget -= self._schedule_chunk(seq, min(num_new_tokens, budget))  # chunked prefill: what is left
            admitted.append(seq)
        return admitted

    def _schedule_chunk(self, seq: Sequence, num_tokens: int) -> int:
        """Count the next `num_tokens` prompt tokens of seq as computed by this step."""
        seq.num_computed_tokens += num_tokens
        self.cache_scheduled_blocks(seq)
        return num_tokens

    def cache_scheduled_blocks(self, seq: Sequence) -> None:
        """Register the blocks the step just scheduled fills (see KVCacheManager.cache_blocks)."""
        self.kv_cache_manager.cache_blocks(seq, seq.num_computed_tokens)

    def _schedule_decodes(self) -> list[Sequence]:
        """One token for each decoding sequence that has room; preempt the newest when blocks run
        out (a part-prefilled sequence too: it is recomputed later, mostly from the prefix cache)."""
        scheduled, visited = [], []
        while self.running and len(scheduled) < min(self.max_num_seqs, self.max_num_batched_tokens):
            seq = self.running.popleft()
            visited.append(seq)
            if seq.is_prefilling:  # its chunk, if any, is scheduled after the decodes
                continue
            while not self.kv_cache_manager.allocate_slots(seq, 1):
                victim = self.running.pop() if self.running else visited.pop()
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(seq)
                self._schedule_chunk(seq, 1)
        self.running.extendleft(reversed(visited))  # keep admission order
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: free seq's blocks and put it at the front of waiting.

        It is prefilled again later over prompt + generated tokens, mostly from the prefix cache.
        """
        seq.status = SequenceStatus.WAITING
        self.kv_cache_manager.free(seq)
        seq.num_cached_tokens = seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update_from_output(self, out: SchedulerOutput, token_ids: list[int]) -> list[Sequence]:
        """Append each sampled sequence's new token and finish the ones that are done.

        Returns:
            The sequences that finished in this step (their blocks are already freed).
        """
        assert len(out.sampled_seqs) == len(token_ids)
        finished = []
        for seq, token_id in zip(out.sampled_seqs, token_ids):
            seq.append_token(token_id)
            reason = self.check_stop(seq, token_id)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def check_stop(self, seq: Sequence, token_id: int) -> str | None:
        """Why seq stops after `token_id` ("stop", "length"), or None."""
        params = seq.sampling_params
        if seq.num_completion_tokens >= params.min_tokens:
            if token_id == self.eos_token_id and not params.ignore_eos:
                return "stop"
            if token_id in params.stop_token_ids:
                seq.stop_reason = token_id
                return "stop"
        if seq.num_completion_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence now (EOS, a stop string, an abort) and free its blocks.

        Finishing an already finished sequence only updates its finish_reason (a stop string found
        in the step that also reached max_tokens reports "stop").
        """
        assert reason in FINISH_REASONS, f"unknown finish reason {reason!r}"
        seq.finish_reason = reason
        if seq.status == SequenceStatus.RUNNING:
            self.kv_cache_manager.free(seq)
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
