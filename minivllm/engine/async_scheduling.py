"""Async scheduling: schedule and launch step N+1 while the device still computes step N.

The synchronous engine (core/engine.py's SyncStepper) takes turns with the device: schedule, run,
wait for the tokens, postprocess, and only then schedule the next step. This layer overlaps them:

    host:   schedule N+1 | launch N+1 | wait N, postprocess N | schedule N+2 | ...
    device: ...... step N ......| ....... step N+1 ....... | ... step N+2 ...

Step N+1 is scheduled before step N's tokens reach the host, so each sequence that step N samples
carries a placeholder token (PLACEHOLDER_TOKEN_ID) until they do: its length, and so the block
bookkeeping, already counts the token in flight, and step N+1 reads the real id on the device.
The core's Scheduler, KVCacheManager and Sequence stay synchronous; this file holds the rest:

    AsyncScheduler  the Scheduler, a decode's full block registered once its last token is known
    AsyncOutputs    the ModelRunner layer: launch a step (its samples copied to the host in the
                    background), collect its tokens later
    AsyncStepper    the stepper the engine uses when async_scheduling is on

vLLM: vllm/v1/core/sched/async_scheduler.py and EngineCore.step_with_batch_queue (vllm/v1/engine/core.py).
"""
import time
from dataclasses import dataclass
from typing import Callable

import torch

from minivllm.core.engine import StepResult
from minivllm.core.model_runner import ModelRunnerOutput
from minivllm.core.scheduler import Scheduler, SchedulerOutput
from minivllm.core.sequence import Sequence
from minivllm.engine.chunked_prefill import ChunkedPrefillScheduler

# Stands in for a token that the device is still sampling (never a real id: those are >= 0).
PLACEHOLDER_TOKEN_ID = -1


class AsyncScheduler(Scheduler):
    """The Scheduler for overlapped steps: a block that a decode's placeholder fills is registered in
    the prefix cache once the token is known (AsyncStepper), not when the decode is scheduled."""

    def cache_scheduled_blocks(self, seq: Sequence) -> None:
        num_known = seq.num_computed_tokens - (seq.last_token == PLACEHOLDER_TOKEN_ID)
        self.kv_cache_manager.cache_blocks(seq, num_known)

    def can_decode_without_preemption(self) -> bool:
        """Would the next step be a decode of every running sequence, with no preemption and no
        prompt chunk? (Only in that steady state does the stepper schedule a decode ahead.)"""
        if self.waiting or not self.running or len(self.running) > min(self.max_num_seqs, self.max_num_batched_tokens):
            return False
        if any(seq.is_prefilling for seq in self.running):
            return False
        num_new_blocks = sum(len(seq.block_table) < seq.num_blocks for seq in self.running)
        return num_new_blocks <= self.kv_cache_manager.num_free_blocks

    def has_decodes_ready(self) -> bool:
        """Chunked prefill: is a running sequence waiting to decode (its last token known)? Then
        the next step must be a mixed one, scheduled after the in-flight step is collected; a
        prefill queued alone would stall it."""
        if not isinstance(self, ChunkedPrefillScheduler):
            return False
        return any(seq.num_uncomputed_tokens == 1 and seq.last_token != PLACEHOLDER_TOKEN_ID
                   for seq in self.running)


@dataclass
class StepHandle:
    """A launched step's samples on their way to the host: non-blocking copies into pinned memory
    plus an event, so the host can schedule the next step while the device still computes this one."""

    token_ids: torch.Tensor  # [num_sampled] int64 on the device (the next step's input ids)
    host: object  # the SamplerOutput's host copies (valid once `done` has passed)
    done: torch.cuda.Event | None
    to_output: Callable  # host copies -> ModelRunnerOutput
    rows: list[int] | None = None  # only these rows (see select)
    launched_as: "StepHandle | None" = None  # the handle `launch` returned, when this one selects rows of it

    def select(self, rows: list[int]) -> "StepHandle":
        """The same step's samples, restricted to `rows` (the sequences still running)."""
        index = torch.tensor(rows, dtype=torch.int64)
        if self.token_ids.is_cuda:
            index = index.pin_memory().to(self.token_ids.device, non_blocking=True)
        return StepHandle(self.token_ids[index], self.host, self.done, self.to_output, rows, self.launched_as or self)

    def wait(self) -> ModelRunnerOutput:
        if self.done is not None:
            self.done.synchronize()
        output = self.to_output(self.host)
        if self.rows is not None:
            output.sampled_token_ids = [output.sampled_token_ids[i] for i in self.rows]
            if getattr(output, "logprobs", None) is not None:
                output.logprobs = [output.logprobs[i] for i in self.rows]
        return output


class AsyncOutputs:
    """ModelRunner layer: `launch` queues a step (forward and sampling) on the device and returns at
    once; `collect` waits for its tokens. A decode launched right behind another takes that step's
    samples, still on the device, as its input ids."""

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, prev_token_ids: torch.Tensor | None = None) -> StepHandle:
        batch = self.upload(self.prepare_inputs(out))
        if prev_token_ids is not None:  # the placeholders' real ids: step N's samples are step N+1's inputs
            batch.input_ids[:len(prev_token_ids)].copy_(prev_token_ids, non_blocking=True)
        sampled = self.sample(out, batch, self.compute_logits(batch, self.forward(batch)))
        on_cuda = self.device.type == "cuda"
        host = sampled.to_host(pin=on_cuda)  # logprobs ride with the ids: copies queued before the event
        done = None
        if on_cuda:
            done = torch.cuda.Event()
            done.record()
        return StepHandle(sampled.token_ids, host, done, self.to_output)

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        return handle.wait()


@dataclass
class InflightStep:
    """A launched step whose tokens have not been collected."""

    out: SchedulerOutput
    handle: StepHandle
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
        executor: launch(out, prev_token_ids=None) -> handle; collect(handle) -> ModelRunnerOutput.
        on_result: the engine's callback for a collected step (StepResult) -> outputs.
    """

    def __init__(self, scheduler: AsyncScheduler, executor, on_result: Callable[[StepResult], list]):
        self.scheduler, self.executor, self.on_result = scheduler, executor, on_result
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

    def has_inflight(self) -> bool:
        return self.inflight is not None

    def holds_any(self, seq_ids: set[int]) -> bool:
        """Does the step in flight compute any of these sequences?"""
        return self.inflight is not None and any(seq.seq_id in seq_ids for seq in self.inflight.out.seqs)

    def drain(self) -> list:
        """Collect the step in flight without launching another; its outputs."""
        inflight, self.inflight = self.inflight, None
        return self.on_result(StepResult(inflight.out, self._take_placeholders(inflight), inflight.start))

    def discard(self) -> None:
        """Forget the step in flight (it failed: its tokens are lost)."""
        self.inflight = None

    def _take_placeholders(self, inflight: InflightStep) -> ModelRunnerOutput:
        """Wait for a launched step's tokens and take its sequences' placeholders back out."""
        output = self.executor.collect(inflight.handle)
        for seq in inflight.out.sampled_seqs:
            assert seq.token_ids.pop() == PLACEHOLDER_TOKEN_ID
        return output

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
        finished = self.on_result(StepResult(prev.out, self._take_placeholders(prev), prev.start))
        rows = [i for i, seq in enumerate(out.seqs) if not seq.is_finished]
        kv_cache_manager = self.scheduler.kv_cache_manager
        for i in rows:
            seq = out.seqs[i]
            # Step N+1 (queued) writes the KV of the token step N sampled: if that token filled a
            # block, later prefills (queued after it) may now hit the block.
            kv_cache_manager.cache_blocks(seq, seq.num_computed_tokens)
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
