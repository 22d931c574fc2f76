"""Which sequences run in the next step: continuous batching with preemption by recompute.

Each step is either a prefill (new prompts, or preempted sequences recomputed) or a decode (one
token for every running sequence), as in nano-vllm. vLLM: vllm/v1/core/sched/scheduler.py.
"""
from collections import deque
from dataclasses import dataclass

from minivllm.engine.block_manager import BlockManager
from minivllm.engine.sequence import Sequence, SequenceStatus

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class SchedulerOutput:
    """The sequences of one step and what the step computes."""

    seqs: list[Sequence]
    is_prefill: bool
    num_batched_tokens: int  # tokens the model computes this step (uncached prompt tokens, or 1 per seq)
    num_cached_tokens: int = 0  # prompt tokens of this prefill served from the prefix cache

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)


class Scheduler:
    """Owns the waiting and running queues and the BlockManager.

        waiting: deque[Sequence]  new prompts at the back, preempted sequences at the front
        running: deque[Sequence]  admission order: the newest is preempted first

    One step:  schedule() -> the runner computes it -> postprocess(seqs, token_ids)
    """

    def __init__(self, config):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos_token_id = config.eos_token_id
        self.block_size = config.kvcache_block_size
        if self.max_num_batched_tokens < self.max_model_len:
            # Without chunked prefill a sequence of max_model_len tokens must fit one step.
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                             f"max_model_len={self.max_model_len}")
        self.block_manager = BlockManager(config.num_kvcache_blocks, self.block_size, config.enable_prefix_caching)
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
        num_blocks_needed = self._max_num_blocks(seq)
        if num_blocks_needed > self.block_manager.num_blocks:
            raise ValueError(
                f"sequence {seq.seq_id} may need {num_blocks_needed} KV blocks (prompt {seq.num_prompt_tokens} + "
                f"max_tokens {seq.sampling_params.max_tokens} tokens, block size {self.block_size}) but the cache "
                f"has only {self.block_manager.num_blocks}; raise num_kvcache_blocks or lower max_tokens")
        self.waiting.append(seq)

    def _max_num_blocks(self, seq: Sequence) -> int:
        # The last sampled token is never written to the cache, hence the - 1.
        max_len = min(seq.num_prompt_tokens + seq.sampling_params.max_tokens, self.max_model_len)
        num_cached_at_most = max(seq.num_tokens, max_len - 1)
        return (num_cached_at_most + self.block_size - 1) // self.block_size

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> SchedulerOutput:
        """Pick the next step: a prefill if any waiting sequence fits now, else a decode."""
        output = self.schedule_prefills()
        if output.seqs:
            return output
        output = self._schedule_decodes()
        assert output.seqs, "nothing to schedule: call schedule() only while not is_finished()"
        return output

    def schedule_prefills(self) -> SchedulerOutput:
        """Admit waiting sequences in order while seats, token budget and blocks allow (no seqs:
        nothing fits now; nothing changed). The engine also calls it alone, to queue one prefill
        behind another (running sequences are not touched).

            max_num_batched_tokens: |== seq A uncached ==|== seq B uncached ==|... free ...|
            (tokens served from the prefix cache cost no budget)
        """
        scheduled, num_batched_tokens, num_cached_tokens = [], 0, 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new_tokens = seq.num_tokens - self.block_manager.get_num_cached_tokens(seq)
            if num_batched_tokens + num_new_tokens > self.max_num_batched_tokens:
                break
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            num_batched_tokens += seq.num_tokens - seq.num_cached_tokens
            num_cached_tokens += seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
        return SchedulerOutput(scheduled, True, num_batched_tokens, num_cached_tokens)

    def _schedule_decodes(self) -> SchedulerOutput:
        """One token for each running sequence that has room; preempt the newest when blocks run out."""
        scheduled = []
        max_decode_seqs = min(self.max_num_seqs, self.max_num_batched_tokens)
        while self.running and len(scheduled) < max_decode_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))  # keep admission order
        return SchedulerOutput(scheduled, False, len(scheduled))

    def can_decode_without_preemption(self) -> bool:
        """Would the next step be a decode of every running sequence, with no preemption?
        (The engine's async scheduling only looks one step ahead in that steady state.)"""
        if self.waiting or not self.running or len(self.running) > min(self.max_num_seqs, self.max_num_batched_tokens):
            return False
        num_new_blocks = sum(len(seq.block_table) < seq.num_blocks for seq in self.running)
        return num_new_blocks <= self.block_manager.num_free_blocks

    def preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: free seq's blocks and put it at the front of waiting.

        It is prefilled again later over prompt + generated tokens, mostly from the prefix cache.
        """
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Append each sequence's new token and finish the ones that are done.

        Returns:
            The sequences that finished in this step (their blocks are already freed).
        """
        assert len(seqs) == len(token_ids)
        finished = []
        for seq, token_id in zip(seqs, token_ids):
            seq.append_token(token_id)
            reason = self._check_stop(seq, token_id)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def _check_stop(self, seq: Sequence, token_id: int) -> str | None:
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
        """End a sequence now (EOS, a stop string found by the engine, or an abort) and free its blocks.

        Finishing an already finished sequence only updates its finish_reason (a stop string found
        in the step that also reached max_tokens reports "stop").
        """
        assert reason in FINISH_REASONS, f"unknown finish reason {reason!r}"
        seq.finish_reason = reason
        if seq.status == SequenceStatus.RUNNING:
            self.block_manager.deallocate(seq)
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
