"""Which sequences run in the next step: continuous batching under a token budget per step, and
preemption by recompute when KV blocks run out.

A step is either a prefill of whole prompts or a decode of every running sequence, as in
nano-vllm (chapter 03). Later: chapter 11's chunked prefill (minivllm/engine/chunked_prefill.py,
the engine's default) subclasses this Scheduler to mix decodes and prompt chunks in one step.
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

        a decode:   seqs: [ d0 ][ d1 ][ d2 ]      num_scheduled_tokens: 1, 1, 1    num_decodes: 3
        a prefill:  seqs: [ p0 ...... ][ p1 .. ]  num_scheduled_tokens: p0's and p1's uncached tokens
        sampled_seqs: the sequences whose step reaches their last token: they get a new token

    The step's tokens of a sequence end at seq.num_computed_tokens: the scheduler has already
    counted them. (Later: chapter 11's mixed steps hold decodes first, then prompt chunks.)
    """

    seqs: list[Sequence]  # decodes first, then prefills
    num_scheduled_tokens: list[int]  # per sequence: 1 for a decode, the tokens it computes for a prefill
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

    Extension point: prefill_size() says how many of an admitted prompt's tokens a step computes
    (all of them here; chapter 11's ChunkedPrefillScheduler overrides it and schedule()).
    """

    def __init__(self, config):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos_token_id = config.eos_token_id
        self.block_size = config.kvcache_block_size
        if self.prefill_size(self.max_model_len, self.max_num_batched_tokens) == 0:
            # A sequence of max_model_len tokens could never be scheduled.
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
        """Pick the next step: a prefill if any waiting sequence fits now, else a decode."""
        output = self.schedule_prefills()
        if not output.seqs:
            output = SchedulerOutput.decodes(self._schedule_decodes())
        assert output.seqs, "nothing to schedule: call schedule() only while not is_finished()"
        return output

    def schedule_prefills(self) -> SchedulerOutput:
        """Admit waiting sequences in order while seats, the token budget and blocks allow, and
        prefill them (no seqs: nothing fits now). Tokens served from the prefix cache cost no budget.

            max_num_batched_tokens: |== seq A uncached ==|== seq B uncached ==|... free ...|
        """
        return self.step_output([], [], 0, self._schedule_waiting(self.max_num_batched_tokens))

    @staticmethod
    def step_output(seqs: list[Sequence], num_tokens: list[int], num_decodes: int,
                    admitted: list[Sequence]) -> SchedulerOutput:
        """The step of `seqs` (already scheduled, `num_tokens` each) and of the newly `admitted`."""
        seqs = seqs + admitted
        num_tokens = num_tokens + [seq.num_computed_tokens - seq.num_cached_tokens for seq in admitted]
        sampled = [seq for seq in seqs if seq.num_computed_tokens == seq.num_tokens]
        return SchedulerOutput(seqs, num_tokens, num_decodes, sampled, sum(seq.num_cached_tokens for seq in admitted))

    def prefill_size(self, num_new_tokens: int, budget: int) -> int:
        """How many of an admitted prompt's `num_new_tokens` uncached tokens this step computes:
        all of them if they fit the `budget`, else 0 (it waits). Chapter 11's chunked prefill
        takes what fits instead."""
        return num_new_tokens if num_new_tokens <= budget else 0

    def _schedule_waiting(self, budget: int) -> list[Sequence]:
        """Admit sequences from the front of waiting, in order, while a seat, `budget` tokens and KV
        blocks allow: each moves to running with blocks for its whole prompt, its cached prefix taken
        from the prefix cache, and its prompt scheduled (prefill_size()). Returns them, in order.

            waiting: [ A ][ B ][ C ] ...    A's uncached tokens, then B's, ... within the budget;
                                           the first that does not fit stops admission (FCFS)
        """
        admitted = []
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            computed = self.kv_cache_manager.get_computed_blocks(seq)
            num_new_tokens = seq.num_tokens - computed.num_tokens
            num_tokens = self.prefill_size(num_new_tokens, budget)
            if num_tokens == 0 or not self.kv_cache_manager.allocate_slots(seq, num_new_tokens, computed):
                break
            seq.num_cached_tokens = seq.num_computed_tokens = computed.num_tokens
            if seq.num_prompt_cached_tokens is None:  # kept across preemption, for the request's output
                seq.num_prompt_cached_tokens = seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            budget -= self._schedule_tokens(seq, num_tokens)
            admitted.append(seq)
        return admitted

    def _schedule_tokens(self, seq: Sequence, num_tokens: int) -> int:
        """Count the next `num_tokens` tokens of seq as computed by this step."""
        seq.num_computed_tokens += num_tokens
        self.cache_scheduled_blocks(seq)
        return num_tokens

    def cache_scheduled_blocks(self, seq: Sequence) -> None:
        """Register the blocks the step just scheduled fills (see KVCacheManager.cache_blocks)."""
        self.kv_cache_manager.cache_blocks(seq, seq.num_computed_tokens)

    def _schedule_decodes(self) -> list[Sequence]:
        """One token for each decoding sequence that has room; preempt the newest when blocks run
        out (it is recomputed later, mostly from the prefix cache)."""
        scheduled, visited = [], []
        while self.running and len(scheduled) < min(self.max_num_seqs, self.max_num_batched_tokens):
            seq = self.running.popleft()
            visited.append(seq)
            if seq.is_prefilling:  # not a decode (later: chapter 11's part-prefilled prompts)
                continue
            while not self.kv_cache_manager.allocate_slots(seq, 1):
                victim = self.running.pop() if self.running else visited.pop()
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(seq)
                self._schedule_tokens(seq, 1)
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
