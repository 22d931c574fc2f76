"""Chunked prefill (chapter 11, the engine's default): one token budget per step, shared by
decodes and prompt chunks.

Chapter 03's Scheduler makes a step either a prefill of whole prompts or a decode, so a long prompt
stalls every decoding sequence for a whole step. This Scheduler fills each step's budget
(`max_num_batched_tokens`) with the running decodes first (one token each), then the next chunk of a
prompt part-way through its prefill, then new prompts; a prompt longer than what is left is split
across steps. It changes two things of the core's: schedule() and the prefill_size() extension
point. vLLM: vllm/v1/core/sched/scheduler.py (chunked prefill is its only mode).
"""
from minivllm.core.scheduler import Scheduler, SchedulerOutput
from minivllm.core.sequence import Sequence


class ChunkedPrefillScheduler(Scheduler):
    """A chunked step, max_num_batched_tokens = 16, three decodes and a 20-token prompt waiting:

        step 1: | d0 | d1 | d2 |  p[0:13] ...................... |   p is part-prefilled
        step 2: | d0 | d1 | d2 |  p[13:20] ....... | free         |   p samples its first token
        step 3: | d0 | d1 | d2 | p  | free .........................|
    """

    def schedule(self) -> SchedulerOutput:
        """Running decodes first, then prompt chunks fill the rest of the token budget."""
        num_preemptions = self.num_preemptions
        decodes = self._schedule_decodes()
        # After a preemption blocks are short: admit nothing new this step (it would be preempted next).
        admit = self.num_preemptions == num_preemptions
        output = self._schedule_chunks(self.max_num_batched_tokens - len(decodes), decodes, admit)
        assert output.seqs, "nothing to schedule: call schedule() only while not is_finished()"
        return output

    def schedule_prefills(self) -> SchedulerOutput:
        """Prompt chunks only (no decodes) within the token budget: the next chunk of part-prefilled
        sequences, then waiting ones admitted in order (async scheduling's step after a prefill)."""
        return self._schedule_chunks(self.max_num_batched_tokens, [], admit=True)

    def prefill_size(self, num_new_tokens: int, budget: int) -> int:
        """A prompt longer than what is left of the budget is admitted anyway: its first chunk
        takes the rest, and the next steps schedule the others."""
        return min(num_new_tokens, budget)

    def _schedule_chunks(self, budget: int, decodes: list[Sequence], admit: bool) -> SchedulerOutput:
        """Fill `budget` tokens with prompt chunks, after the step's `decodes` (already scheduled)."""
        seqs, num_tokens = list(decodes), [1] * len(decodes)
        for seq in [s for s in self.running if s.is_prefilling]:  # part-prefilled first, oldest first
            if budget == 0:
                break
            num_tokens.append(self._schedule_tokens(seq, min(seq.num_uncomputed_tokens, budget)))
            seqs.append(seq)
            budget -= num_tokens[-1]
        admitted = self._schedule_waiting(budget) if admit else []
        return self.step_output(seqs, num_tokens, len(decodes), admitted)
