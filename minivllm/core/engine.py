"""The engine loop: sequences in, one scheduled step at a time, tokens out.

    add(seq)   -> the scheduler's waiting queue
    step():    out    = scheduler.schedule()
               output = executor.execute_model(out)        one token id per sampled sequence
               scheduler.update_from_output(out, output.sampled_token_ids)   append, stop, free
               -> [StepResult(out, output)]

A stepper runs those three lines; a layer may swap in one that schedules a step while the previous
one still runs (minivllm/engine/'s AsyncStepper). The executor is the ModelRunner on one device.
Requests, text and RequestOutputs are the LLMEngine's, above this.
vLLM: vllm/v1/engine/core.py (EngineCore.step); nano-vllm: nanovllm/engine/llm_engine.py.
"""
import time
from dataclasses import dataclass
from typing import Callable

from minivllm.core.model_runner import ModelRunnerOutput
from minivllm.core.scheduler import Scheduler, SchedulerOutput
from minivllm.core.sequence import Sequence
from minivllm.sampling_params import SamplingParams


@dataclass
class StepResult:
    """One step whose tokens have arrived (and been appended to its sequences)."""

    scheduler_output: SchedulerOutput
    output: ModelRunnerOutput
    start_time: float  # time.perf_counter() when the step was scheduled


class SyncStepper:
    """Schedule, run, collect: one step per call, the host waiting for the device in between."""

    def __init__(self, scheduler: Scheduler, executor, on_result: Callable[[StepResult], list]):
        self.scheduler, self.executor, self.on_result = scheduler, executor, on_result

    def step(self) -> list:
        start = time.perf_counter()
        out = self.scheduler.schedule()
        return self.on_result(StepResult(out, self.executor.execute_model(out), start))

    # A stepper that runs ahead has a step in flight between calls; this one never has.
    def has_inflight(self) -> bool:
        return False

    def holds_any(self, seq_ids: set[int]) -> bool:
        return False

    def drain(self) -> list:
        return []

    def discard(self) -> None:
        pass


class Engine:
    """Steps a Scheduler and an executor.

    Args:
        scheduler: the Scheduler (or a layer's subclass).
        executor: execute_model(SchedulerOutput) -> ModelRunnerOutput (a ModelRunner).
        stepper: the stepper class (SyncStepper, or a layer's).
        on_result: called with each StepResult after the scheduler has taken its tokens; what it
            returns, step() returns (default: the StepResult itself).
    """

    def __init__(self, scheduler: Scheduler, executor, stepper=SyncStepper,
                 on_result: Callable[[StepResult], list] | None = None):
        self.scheduler, self.executor = scheduler, executor
        self.on_result = on_result or (lambda result: [result])
        self.stepper = stepper(scheduler, executor, self._update)

    def _update(self, result: StepResult) -> list:
        self.scheduler.update_from_output(result.scheduler_output, result.output.sampled_token_ids)
        return self.on_result(result)

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.stepper.has_inflight() or not self.scheduler.is_finished()

    def step(self) -> list:
        return self.stepper.step()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Every prompt's completion token ids (the loop of nano-vllm's generate)."""
        seqs = [Sequence(prompt, params, self.scheduler.block_size) for prompt in prompts]
        for seq in seqs:
            self.add(seq)
        while self.has_unfinished():
            self.step()
        return [seq.completion_token_ids for seq in seqs]
