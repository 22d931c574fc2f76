"""Chapter 03 exercise: the scheduler's schedule(), a step that is either a prefill of newly admitted prompts or a decode of every running sequence, with preemption when KV
blocks run out. Write both methods' bodies; `make exercise CH=03` runs the scheduler's tests with them.
Stuck? chapters/exercises/hints/03_scheduler.md, one level at a time.

They replace methods of minivllm/core/scheduler.py's Scheduler: `self` is the scheduler, with its
queues (self.running, self.waiting: deques), self.kv_cache_manager, its limits (self.max_num_seqs,
self.max_num_batched_tokens) and its other methods, which stay the engine's. schedule() is

    output = self.schedule_prefills()      # -> _schedule_waiting(max_num_batched_tokens): yours
    if not output.seqs:                    #    (it packs what you return into a SchedulerOutput)
        output = SchedulerOutput.decodes(self._schedule_decodes())   # yours

and yours call self.kv_cache_manager, self.preempt, self.prefill_size and self._schedule_tokens.
(Later: chapter 11's chunked prefill calls the same two methods in every step.)
"""
from minivllm.core.sequence import Sequence, SequenceStatus  # noqa: F401 (for your admission)


def _schedule_waiting(self, budget: int) -> list[Sequence]:
    """Exercise 03.1, admission: move sequences from the front of self.waiting to self.running
    while a seat, the token budget and KV blocks allow, and schedule each one's prompt (chapter 03,
    "Scheduler"). Replaces Scheduler._schedule_waiting.

    budget: tokens the admitted prompts may take in this step (max_num_batched_tokens here).

    - Admission is in order (first come, first served): the first waiting sequence that does not
      fit ends admission, and nobody behind it jumps the queue.
    - Limits: a seat (len(self.running) < self.max_num_seqs), budget left, and blocks:
      kv = self.kv_cache_manager; computed = kv.get_computed_blocks(seq) is its cached prefix
      (chapter 04; nothing without prefix caching), and kv.allocate_slots(seq, num_new_tokens,
      computed) takes blocks for the rest of its tokens, seq.num_tokens - computed.num_tokens
      (False, with nothing taken, when blocks are short). Only those uncached tokens count against
      the budget: n = self.prefill_size(num_new_tokens, budget) is how many this step computes, 0
      when they do not fit what is left (then it does not fit; later, chapter 11 overrides it).
    - Admitting a sequence: seq.num_cached_tokens and seq.num_computed_tokens become the cached
      prefix's token count; seq.num_prompt_cached_tokens too, but only if it is still None (it keeps
      the first admission's hit across preemptions); seq.status = SequenceStatus.RUNNING; it leaves
      the front of waiting for the back of running. Then self._schedule_tokens(seq, n) counts its n
      scheduled tokens as computed by this step (and registers the blocks they fill).

    Returns the admitted sequences, in order ([]: nothing fits now, and the step decodes).
    """
    raise NotImplementedError("exercise 03.1 (_schedule_waiting) is not written yet: fill it in, "
                              "chapters/exercises/ex03_scheduler.py; read chapters/03_scheduler.md, 'Scheduler'")


def _schedule_decodes(self) -> list[Sequence]:
    """Exercise 03.1, decodes: one token for each running sequence that is past its prompt, and
    preemption by recompute when KV blocks run out (chapter 03, "Preemption by recompute").
    Replaces Scheduler._schedule_decodes.

    - A decoding sequence is scheduled once self.kv_cache_manager.allocate_slots(seq, 1) has given
      its next token a slot; self._schedule_tokens(seq, 1) then counts that token as computed.
    - Running sequences are served oldest first (self.running is in admission order, the oldest
      on the left), at most min(self.max_num_seqs, self.max_num_batched_tokens) of them.
    - When a sequence's token finds no block, the newest running sequences are preempted
      (self.preempt: it frees their blocks and puts them at the front of waiting), one at a time,
      until it fits; when it is itself the newest left, it is the one preempted. A sequence already
      scheduled in this step is never preempted.
    - A sequence still prefilling (seq.is_prefilling; later: only with chapter 11's chunked prefill) gets
      no token here (its chunk is scheduled after the decodes) but stays running, and can be
      preempted like any other.
    - Afterwards self.running holds every sequence that was not preempted, in the order it had.

    Returns the scheduled sequences, oldest first.
    """
    raise NotImplementedError("exercise 03.1 (_schedule_decodes) is not written yet: fill it in, "
                              "chapters/exercises/ex03_scheduler.py; read chapters/03_scheduler.md, "
                              "'Preemption by recompute'")
