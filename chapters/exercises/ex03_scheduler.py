"""Chapter 03 exercises: the two halves of Scheduler.schedule(), the decodes with preemption and the
prompt chunks under the token budget. Write each method's body; `make exercise CH=03` runs the
scheduler's tests with them. Stuck? chapters/exercises/hints/03_scheduler.md, one level at a time.

They replace methods of minivllm/core/scheduler.py's Scheduler: `self` is the scheduler, with its
queues (self.running, self.waiting: deques), self.kv_cache_manager, its limits (self.max_num_seqs,
self.max_num_batched_tokens) and its other methods, which stay the engine's: schedule() calls yours,
and yours call self.preempt, self._admit and self._schedule_chunk.
"""
from minivllm.core.scheduler import SchedulerOutput
from minivllm.core.sequence import Sequence


def _schedule_decodes(self) -> list[Sequence]:
    """Exercise 03.1: the decode half of a step, one token for each running sequence that is past
    its prompt, and preemption by recompute when KV blocks run out (chapter 03, "Preemption by
    recompute"). Replaces Scheduler._schedule_decodes; schedule() calls it first in every step that
    decodes.

    - A decoding sequence is scheduled once self.kv_cache_manager.allocate_slots(seq, 1) has given
      its next token a slot; self._schedule_chunk(seq, 1) then counts that token as computed.
    - Running sequences are served oldest first (self.running is in admission order, the oldest
      on the left), at most min(self.max_num_seqs, self.max_num_batched_tokens) of them.
    - When a sequence's token finds no block, the newest running sequences are preempted
      (self.preempt: it frees their blocks and puts them at the front of waiting), one at a time,
      until it fits; when it is itself the newest left, it is the one preempted. A sequence already
      scheduled in this step is never preempted.
    - A sequence still prefilling (seq.is_prefilling) gets no token here (its chunk is scheduled
      after the decodes) but stays running, and can be preempted like any other.
    - Afterwards self.running holds every sequence that was not preempted, in the order it had.

    Returns the scheduled sequences, oldest first.
    """
    raise NotImplementedError("exercise 03.1 (_schedule_decodes) is not written yet: fill it in, "
                              "chapters/exercises/ex03_scheduler.py; read chapters/03_scheduler.md, "
                              "'Preemption by recompute'")


def _schedule_chunks(self, budget: int, decodes: list[Sequence], admit: bool) -> SchedulerOutput:
    """Exercise 03.2: fill the step's token budget with prompt chunks, after its decodes (chapter
    03, "Scheduler"; chunks of a prompt split over steps are chapter 11's). Replaces
    Scheduler._schedule_chunks: schedule() calls it with what the decodes left of
    max_num_batched_tokens, schedule_prefills with the whole budget and no decodes.

    budget:  tokens the prompt chunks may take in this step
    decodes: the sequences _schedule_decodes scheduled (one token each, already counted)
    admit:   whether waiting sequences may be admitted (False in a step that preempted)

    - Running sequences still prefilling (seq.is_prefilling: admitted in an earlier step, their
      prompt only partly computed) get their next chunk first, oldest first; then sequences are
      admitted from the front of self.waiting, in order, while admit, a seat
      (len(self.running) < self.max_num_seqs) and budget remain. self._admit(seq, budget) admits
      the first waiting sequence (prefix-cache lookup, blocks, into running) and returns its first
      chunk's length; 0 means it does not fit now, and then nobody behind it is admitted either.
    - self._schedule_chunk(seq, num_tokens) counts a chunk as computed by this step. A chunk is
      never longer than what its sequence has left to compute (seq.num_uncomputed_tokens), and the
      chunks together never take more than `budget` tokens.

    Returns SchedulerOutput(seqs, num_scheduled_tokens, num_decodes, sampled_seqs, num_cached_tokens):
    seqs the decodes then every chunk's sequence in the order scheduled; num_scheduled_tokens 1 per
    decode then each chunk's length; num_decodes = len(decodes); sampled_seqs the sequences of seqs
    whose step reaches their last token (num_computed_tokens == num_tokens), in the same order;
    num_cached_tokens the prefix-cache hits (seq.num_cached_tokens) of the sequences this call admitted.
    """
    raise NotImplementedError("exercise 03.2 (_schedule_chunks) is not written yet: fill it in, "
                              "chapters/exercises/ex03_scheduler.py; read chapters/03_scheduler.md, 'Scheduler'")
