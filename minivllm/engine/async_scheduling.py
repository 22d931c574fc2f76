"""Async scheduling: schedule and launch step N+1 while the device still computes step N.

The synchronous engine (llm_engine.py) takes turns with the device: schedule, launch, wait for the
tokens, postprocess, and only then schedule the next step. This layer wraps it and overlaps them:

    host:   schedule N+1 | launch N+1 | wait N, postprocess N | schedule N+2 | ...
    device: ...... step N ......| ....... step N+1 ....... | ... step N+2 ...

Step N+1 is scheduled before step N's tokens reach the host, so each sequence that step N samples
carries a placeholder token (PLACEHOLDER_TOKEN_ID) until they do: its length, and so the block
bookkeeping, already counts the token in flight, and step N+1 reads the real id on the device.
The Scheduler, BlockManager and Sequence stay synchronous; this file holds the rest:

    AsyncScheduler  the Scheduler, with a decode's block hash deferred while its token is in flight
    AsyncStepper    the step driver the engine uses when async_scheduling is on

vLLM: vllm/v1/core/sched/async_scheduler.py and EngineCore.step_with_batch_queue (vllm/v1/engine/core.py).
"""
import time
from dataclasses import dataclass
from typing import Callable

from minivllm.engine.scheduler import Scheduler, SchedulerOutput
from minivllm.engine.sequence import Sequence

# Stands in for a token that the device is still sampling (never a real id: those are >= 0).
PLACEHOLDER_TOKEN_ID = -1


class AsyncScheduler(Scheduler):
    """The Scheduler for overlapped steps: a decode whose last token is a placeholder gets its slot
    now and its full block registered in the prefix cache once the token is known
    (`AsyncStepper`, via BlockManager.commit_full_block)."""

    def _append_slot(self, seq: Sequence) -> None:
        if seq.last_token == PLACEHOLDER_TOKEN_ID:
            self.block_manager.append_slot(seq)
        else:
            self.block_manager.may_append(seq)

    def can_decode_without_preemption(self) -> bool:
        """Would the next step be a decode of every running sequence, with no preemption and no
        prompt chunk? (Only in that steady state does the stepper schedule a decode ahead.)"""
        if self.waiting or not self.running or len(self.running) > self._max_num_decodes():
            return False
        if any(seq.is_prefilling for seq in self.running):
            return False
        num_new_blocks = sum(len(seq.block_table) < seq.num_blocks for seq in self.running)
        return num_new_blocks <= self.block_manager.num_free_blocks

    def has_decodes_ready(self) -> bool:
        """Chunked prefill: is a running sequence waiting to decode (its last token known)? Then
        the next step must be a mixed one, scheduled after the in-flight step is collected; a
        prefill queued alone would stall it."""
        if not self.enable_chunked_prefill:
            return False
        return any(seq.num_uncomputed_tokens == 1 and seq.last_token != PLACEHOLDER_TOKEN_ID
                   for seq in self.running)


@dataclass
class InflightStep:
    """A launched step whose tokens have not been collected."""

    out: SchedulerOutput
    handle: object  # the executor's StepHandle
    start: float  # time.perf_counter() when it was scheduled


def add_placeholders(seqs: list[Sequence]) -> None:
    for seq in seqs:
        seq.append_token(PLACEHOLDER_TOKEN_ID)


class AsyncStepper:
    """Runs the engine's steps one ahead of their results. Each `step()` call launches the next
    step (when one can be scheduled without the tokens in flight) and then collects the previous
    one, returning its outputs; otherwise it drains (collects without launching).

        nothing in flight:     schedule N, launch N                        -> no outputs yet
        decode N in flight:    schedule N+1 (same sequences), launch N+1 fed with N's samples on
                               the device, collect N                       -> N's outputs
        prefill N in flight:   queue the next prefill N+1, collect N        -> N's outputs
        anything else:         collect N (drain)                            -> N's outputs

    Args:
        scheduler: the engine's AsyncScheduler.
        executor: launch(out, input_ids=None) -> handle; collect(handle) -> token ids.
        postprocess: the engine's postprocess(out, token_ids, start, handle) -> outputs.
    """

    def __init__(self, scheduler: AsyncScheduler, executor, postprocess: Callable):
        self.scheduler, self.executor, self.postprocess = scheduler, executor, postprocess
        self.inflight: InflightStep | None = None

    def step(self) -> list:
        if self.inflight is None:
            start = time.perf_counter()
            out = self.scheduler.schedule()
            handle = self.executor.launch(out)
            add_placeholders(out.sampled_seqs)
            self.inflight = InflightStep(out, handle, start)
            return []
        if self.inflight.out.is_prefill:
            return self._step_after_prefill()
        return self._step_after_decode()

    def holds_any(self, seq_ids: set[int]) -> bool:
        """Does the step in flight compute any of these sequences?"""
        return self.inflight is not None and any(seq.seq_id in seq_ids for seq in self.inflight.out.seqs)

    def drain(self) -> list:
        """Collect the step in flight without launching another; its outputs."""
        inflight, self.inflight = self.inflight, None
        return self.postprocess(inflight.out, self._take_placeholders(inflight), inflight.start, inflight.handle)

    def discard(self) -> None:
        """Forget the step in flight (it failed: its tokens are lost)."""
        self.inflight = None

    def _take_placeholders(self, inflight: InflightStep) -> list[int]:
        """Wait for a launched step's tokens and take its sequences' placeholders back out."""
        token_ids = self.executor.collect(inflight.handle)
        for seq in inflight.out.sampled_seqs:
            assert seq.token_ids.pop() == PLACEHOLDER_TOKEN_ID
        return token_ids

    def _step_after_decode(self) -> list:
        """Decode N+1 of exactly the sequences of decode N; prompt chunks, new prompts or a
        preemption next: drain first."""
        prev = self.inflight
        if not self.scheduler.can_decode_without_preemption() or len(self.scheduler.running) != len(prev.out.seqs):
            return self.drain()
        self.inflight = None
        start = time.perf_counter()
        out = self.scheduler.schedule()
        assert [s.seq_id for s in out.seqs] == [s.seq_id for s in prev.out.seqs]
        # Step N's samples are step N+1's input ids: they never leave the device for that.
        handle = self.executor.launch(out, prev.handle.token_ids)
        finished = self.postprocess(prev.out, self._take_placeholders(prev), prev.start, prev.handle)
        rows = [i for i, seq in enumerate(out.seqs) if not seq.is_finished]
        block_manager = self.scheduler.block_manager
        for i in rows:
            seq = out.seqs[i]
            # Step N+1 (queued) writes the KV of the token step N sampled: if that token filled a
            # block, later prefills (queued after it) may now hit the block.
            block_manager.commit_full_block(seq)
            seq.append_token(PLACEHOLDER_TOKEN_ID)
        if rows:  # the rows of sequences that finished in step N are computed and discarded
            live = [out.seqs[i] for i in rows]
            if len(rows) < len(out.seqs):
                handle = handle.select(rows)
            self.inflight = InflightStep(SchedulerOutput.decodes(live), handle, start)
        return finished

    def _step_after_prefill(self) -> list:
        """A prefill is in flight: queue the next prefill behind it (prompt chunks, which wait for
        no sampled token), then collect it. Anything else first drains it: a decode, and with
        chunked prefill a mixed step (decode rows in flight, or a sequence ready to decode) so that
        decoding sequences advance every step."""
        if self.inflight.out.num_decodes or self.scheduler.has_decodes_ready():
            return self.drain()
        start = time.perf_counter()
        out = self.scheduler.schedule_prefills()
        if not out.seqs:
            return self.drain()
        handle = self.executor.launch(out)
        finished = self.drain()
        add_placeholders(out.sampled_seqs)
        self.inflight = InflightStep(out, handle, start)
        return finished
