"""Chapter 03 exercises: the scheduler's decode step with preemption, and when a request finishes.
Write each function's body; `make exercise CH=03` runs the scheduler's tests with them.

They replace methods of minivllm/core/scheduler.py's Scheduler: `self` is the scheduler, with
its queues (self.running, self.waiting: deques), self.kv_cache_manager, and its other methods
(use self.preempt and self._schedule_chunk).
"""
from minivllm.core.sequence import Sequence


def _schedule_decodes(self) -> list[Sequence]:
    """Exercise 03.1: one token for each decoding sequence, preempting when blocks run out
    (chapter 03, "Preemption by recompute"). Replaces Scheduler._schedule_decodes.

    Visit self.running from the oldest (left) end, at most until min(self.max_num_seqs,
    self.max_num_batched_tokens) are scheduled:
    - a sequence still prefilling (seq.is_prefilling) is skipped here (its chunk comes later) but
      stays in running;
    - while self.kv_cache_manager.allocate_slots(seq, 1) is False (no block for the token when it
      starts one), preempt the NEWEST running sequence (self.preempt(self.running.pop()): it frees
      its blocks and goes to the front of waiting); if no other sequence is left, preempt seq
      itself and move on;
    - once it has its slot: self._schedule_chunk(seq, 1) (counts the token as computed and
      registers a block it fills), schedule it.
    Every sequence visited and not preempted must end up back in self.running, in the order it
    was (admission order: the next preemption again takes the newest).

    Returns the scheduled sequences, oldest first.
    """
    raise NotImplementedError("exercise 03.1 (_schedule_decodes) is not written yet: fill it in, "
                              "chapters/exercises/ex03_scheduler.py; read chapters/03_scheduler.md, "
                              "'Preemption by recompute'")


def check_stop(self, seq: Sequence, token_id: int) -> str | None:
    """Exercise 03.2: after `token_id` was appended to `seq`, is it finished, and why?
    (chapter 03, "Scheduler"). Replaces Scheduler.check_stop.

    params = seq.sampling_params. Only once seq.num_completion_tokens >= params.min_tokens:
    the end-of-sequence token (self.eos_token_id) stops it, unless params.ignore_eos; a token of
    params.stop_token_ids stops it and is recorded in seq.stop_reason. Either returns "stop".
    Whatever the token: "length" once params.max_tokens tokens were generated or the sequence
    holds self.max_model_len tokens. Otherwise None (it goes on).
    """
    raise NotImplementedError("exercise 03.2 (check_stop) is not written yet: fill it in, "
                              "chapters/exercises/ex03_scheduler.py; read chapters/03_scheduler.md, 'Scheduler'")
