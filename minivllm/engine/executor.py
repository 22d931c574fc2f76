"""Tensor parallelism's executor: rank 0 in the caller's process, ranks 1..N-1 in worker processes.

The engine calls `execute_model` (or `launch` / `collect`) as it would on one device and never learns
how many ranks there are. Every step, rank 0's runner prepares the step's inputs (StepInputs, host
arrays) and uploads them; as its forward begins it broadcasts them, and the input ids from the
device; every rank uploads the same and runs its shard:

    rank 0 (engine process)                          rank r (worker process)
    prepare_inputs, upload
    forward: StepInputs --gloo broadcast-->          receive StepInputs, upload
             input ids --broadcast (NCCL/gloo)-->    into its own input ids
             the model (all-reduces) <------------>  the model (all-reduces)
    LM head shard, gather logits <-----------------  LM head shard
    sample

`TensorParallel` is the ModelRunner layer of every rank (the KV cache's size is the smallest any rank
can hold; rank 0 broadcasts the inputs); StepInputs travel field by field, whatever its class.
vLLM: vllm/v1/executor/multiproc_executor.py and vllm/distributed/ (broadcast_tensor_dict).
"""
import logging
import multiprocessing.connection
import os
import signal
import threading
import time
import weakref
from dataclasses import dataclass, fields
from enum import IntEnum

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing

from minivllm.config import Config
from minivllm.core.model_runner import StepInputs
from minivllm.utils.distributed import Rendezvous, TPGroup, all_reduce_min, device_for_rank

logger = logging.getLogger("minivllm")

WORKER_EXIT_TIMEOUT_S = 10.0  # a worker told to stop has this long before it is killed


# ----------------------------------------------------------------------------- the step message

class StepKind(IntEnum):
    STEP = 1
    SHUTDOWN = 2


MAX_FIELDS = 24  # fields of a StepInputs class (a layer's subclass may add a few)
HEADER_SIZE = 1 + 4 * MAX_FIELDS  # kind, then per field (tag, dtype, dim 0, dim 1)
_NONE, _SCALAR, _ARRAY = 0, 1, 2
_DTYPES = (np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.bool_))


def encode_step(inputs: StepInputs | None) -> tuple[np.ndarray, np.ndarray]:
    """(header [HEADER_SIZE] int64, payload int32) of a step's inputs (None: shut down). Arrays go as
    int32 (token ids, positions, slots, block ids and rows all fit) and come back in their own dtype."""
    header = np.zeros(HEADER_SIZE, dtype=np.int64)
    if inputs is None:
        header[0] = StepKind.SHUTDOWN
        return header, np.zeros(0, dtype=np.int32)
    header[0], parts = StepKind.STEP, []
    for i, f in enumerate(fields(inputs)):
        value, slot = getattr(inputs, f.name), header[1 + 4 * i:5 + 4 * i]
        if isinstance(value, np.ndarray):
            shape = value.shape if value.ndim == 2 else (value.shape[0], -1)
            slot[:] = (_ARRAY, _DTYPES.index(value.dtype), *shape)
            parts.append(value.astype(np.int32, copy=False).ravel())
        elif value is not None:
            slot[:] = (_SCALAR, 0, int(value), 0)
    return header, np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def decode_step(cls: type, header: np.ndarray, payload: np.ndarray) -> StepInputs:
    """The StepInputs (of class `cls`) that encode_step packed."""
    values, offset = {}, 0
    for i, f in enumerate(fields(cls)):
        tag, dtype, dim0, dim1 = header[1 + 4 * i:5 + 4 * i].tolist()
        if tag == _ARRAY:
            shape = (dim0,) if dim1 == -1 else (dim0, dim1)
            size = dim0 * max(dim1, 1)
            values[f.name] = payload[offset:offset + size].reshape(shape).astype(_DTYPES[dtype])
            offset += size
        elif tag == _SCALAR:
            values[f.name] = dim0 if f.type is not bool and f.type != "bool" else bool(dim0)
        else:
            values[f.name] = None
    return cls(**values)


class StepChannel:
    """Rank 0 `send`s each step's inputs; the other ranks `receive` them (on the gloo group: host
    arrays, so a worker reads the step's shape before it allocates anything)."""

    def __init__(self, group: TPGroup):
        self.group = group
        self._header = torch.zeros(HEADER_SIZE, dtype=torch.int64)

    def send(self, inputs: StepInputs | None):
        header, payload = encode_step(inputs)
        self._header.copy_(torch.from_numpy(header))
        dist.broadcast(self._header, src=0, group=self.group.control)
        if payload.size:
            dist.broadcast(torch.from_numpy(payload), src=0, group=self.group.control)

    def receive(self, cls: type) -> StepInputs | None:
        dist.broadcast(self._header, src=0, group=self.group.control)
        header = self._header.numpy()
        if header[0] == StepKind.SHUTDOWN:
            return None
        slots = header[1:].reshape(MAX_FIELDS, 4)  # (tag, dtype, dim 0, dim 1) per field
        size = int(sum(dim0 * max(dim1, 1) for tag, _, dim0, dim1 in slots.tolist() if tag == _ARRAY))
        payload = torch.empty(size, dtype=torch.int32)
        if size:
            dist.broadcast(payload, src=0, group=self.group.control)
        return decode_step(cls, header, payload.numpy())


class TensorParallel:
    """ModelRunner layer of every rank: the KV cache holds as many blocks as the smallest rank can
    (a block id means the same slots everywhere), and rank 0 sends each step's inputs as its forward
    begins. The input ids follow as a device tensor: with async scheduling some are the previous
    step's samples, which only the device has."""

    channel: StepChannel | None = None  # rank 0's, set by the executor

    def num_kv_blocks(self) -> int:
        return all_reduce_min(super().num_kv_blocks(), self.device)

    def forward(self, batch) -> torch.Tensor:
        if self.channel is not None:  # rank 0
            self.channel.send(batch.inputs)
            dist.broadcast(batch.input_ids, src=0)
        return super().forward(batch)

    def run_received_step(self, inputs: StepInputs):
        """A worker's part of a step: the forward and the LM head (whose gather rank 0 collects)."""
        batch = self.upload(inputs)
        dist.broadcast(batch.input_ids, src=0)  # rank 0's, into this rank's own input buffer
        self.compute_logits(batch, super().forward(batch))


# ----------------------------------------------------------------------------- worker processes

def _worker_main(index: int, config: Config, rendezvous: Rendezvous, parent_pid: int):
    """Rank index + 1: join the group, build this rank's shard, run the steps rank 0 sends."""
    rank = index + 1
    # Ctrl-C in a terminal reaches every process of the group: rank 0 decides, then stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    device = device_for_rank(config.device, rank)
    group = TPGroup.join(rendezvous, rank, config.tensor_parallel_size, device)
    from minivllm.engine.assemble import build_model_runner

    runner = build_model_runner(config, device, rank)
    channel = StepChannel(group)
    with torch.inference_mode():
        while (inputs := channel.receive(runner.step_inputs_class)) is not None:
            runner.run_received_step(inputs)
    group.leave()


def _exit_when_orphaned(parent_pid: int, poll_s: float = 0.5):
    """A worker whose engine process died (even by SIGKILL) exits instead of waiting forever."""
    while os.getppid() == parent_pid:
        time.sleep(poll_s)
    os._exit(1)


@dataclass
class WorkerFailure:
    rank: int
    pid: int
    exitcode: int | None
    during_startup: bool
    detail: str = ""  # the worker's traceback, when it raised

    def message(self) -> str:
        code = self.exitcode
        how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}")
        if self.during_startup:
            return (f"tensor-parallel worker rank {self.rank} (pid {self.pid}) {how} while the engine started "
                    f"(its error is printed above; a script that starts a tensor-parallel engine must guard its "
                    f"entry point with `if __name__ == \"__main__\":`, as spawned workers import it)"
                    + (f"\n{self.detail}" if self.detail else ""))
        return (f"tensor-parallel worker rank {self.rank} (pid {self.pid}) {how}; the engine cannot continue, "
                f"create a new LLM" + (f"\n{self.detail}" if self.detail else ""))


class WorkerDiedError(RuntimeError):
    pass


class Workers:
    """The worker processes and their watchdog. Holds no reference to the executor, so that the
    executor's finalizer (which calls `shutdown`) runs when the engine is garbage-collected."""

    def __init__(self, config: Config, rendezvous: Rendezvous):
        self.on_cuda = config.device.startswith("cuda")
        self.group: TPGroup | None = None
        self.failure: WorkerFailure | None = None
        self.in_step = False  # an exception escaped a step: the workers may be inside its collectives
        self.closed = False
        self.context = torch.multiprocessing.start_processes(
            _worker_main, args=(config, rendezvous, os.getpid()), nprocs=config.tensor_parallel_size - 1,
            join=False, daemon=True, start_method="spawn")
        self.processes = self.context.processes
        self._stop_reader, self._stop_writer = multiprocessing.Pipe(duplex=False)
        self._watchdog = threading.Thread(target=self._watch, name="minivllm-tp-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def _watch(self):
        """Wait for a worker to exit or for shutdown. A worker that exits first is a failure: record
        it, and abort NCCL so that rank 0 is not left waiting on a collective that cannot finish."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, start=1)}
        ready = multiprocessing.connection.wait([*sentinels, self._stop_reader])
        if self.closed or self._stop_reader in ready:
            return
        rank = sentinels[ready[0]]
        process = self.processes[rank - 1]
        process.join(1.0)
        detail = self._traceback_of_failed_worker() if (process.exitcode or 0) > 0 else ""
        self.failure = WorkerFailure(rank, process.pid, process.exitcode, self.group is None, detail)
        logger.error("%s", self.failure.message())
        if self.on_cuda and dist.is_initialized():
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception as exc:  # best effort: the error is reported either way
                logger.warning("could not abort the NCCL process group: %s", str(exc))

    def _traceback_of_failed_worker(self) -> str:
        try:
            self.context.join(timeout=0)  # raises with the worker's traceback when it raised
        except Exception as exc:
            return str(exc)
        finally:
            for path in self.context.error_files:  # where a worker that raised wrote its traceback
                if os.path.exists(path):
                    os.unlink(path)
        return ""

    def check(self):
        if self.failure is not None:
            raise WorkerDiedError(self.failure.message())

    def error_for(self, exc: BaseException, wait_s: float = 3.0) -> WorkerDiedError | None:
        """The clear error to raise instead of `exc` when `exc` is a collective failing because a
        worker died (gloo reports the lost connection as soon as the process is gone; give the
        watchdog a moment to see the exit too). None when `exc` should propagate as it is."""
        if not isinstance(exc, RuntimeError) or isinstance(exc, WorkerDiedError):
            return None
        sentinels = [p.sentinel for p in self.processes]
        if self.failure is None and multiprocessing.connection.wait(sentinels, wait_s):
            self._watchdog.join(wait_s)
        return None if self.failure is None else WorkerDiedError(self.failure.message())

    def call_while_alive(self, fn, *args, poll_s: float = 0.1):
        """Run fn(*args) in a helper thread while watching the workers: for the rendezvous, which
        would otherwise wait for a dead worker until its timeout."""
        result = {}

        def target():
            try:
                result["value"] = fn(*args)
            except BaseException as exc:
                result["error"] = exc

        thread = threading.Thread(target=target, name="minivllm-tp-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(poll_s)
            self.check()
        if "error" in result:
            raise result["error"]
        return result["value"]

    def shutdown(self):
        """Tell the workers to stop, wait a bounded time, kill what is left, leave the group."""
        if self.closed:
            return
        self.closed = True
        self._stop_writer.close()
        healthy = self.failure is None and not self.in_step and self.group is not None
        if healthy:
            try:
                StepChannel(self.group).send(None)
            except Exception as exc:  # a worker died meanwhile: it is killed below
                logger.warning("could not send the shutdown message to the workers: %s", str(exc))
        deadline = time.monotonic() + (WORKER_EXIT_TIMEOUT_S if healthy else 0.0)
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(WORKER_EXIT_TIMEOUT_S)
        if self.group is not None:
            self.group.leave()
        self._watchdog.join(WORKER_EXIT_TIMEOUT_S)


class MultiprocExecutor:
    """Tensor parallelism: rank 0 in this process, ranks 1..N-1 in worker processes (spawned)."""

    def __init__(self, config: Config):
        rendezvous = Rendezvous.from_env()
        self.workers = Workers(config, rendezvous)
        # runs at garbage collection or interpreter exit if shutdown() was not called
        self._finalizer = weakref.finalize(self, self.workers.shutdown)
        try:
            device = device_for_rank(config.device, 0)
            if device.type == "cuda":
                torch.cuda.set_device(device)  # this thread's device: graphs, events and NCCL use it
            self.workers.group = self.workers.call_while_alive(
                TPGroup.join, rendezvous, 0, config.tensor_parallel_size, device)
            from minivllm.engine.assemble import build_model_runner

            self.model_runner = build_model_runner(config, device, 0)
            self.model_runner.channel = StepChannel(self.workers.group)
        except BaseException as exc:
            self.workers.in_step = True  # the workers may be inside a collective: kill them
            error = self.workers.error_for(exc)
            self._finalizer()
            if error is not None:
                raise error from exc
            raise
        logger.info("tensor parallel: %d ranks, worker pids %s", config.tensor_parallel_size, self.workers.pids)

    @property
    def worker_pids(self) -> list[int]:
        return self.workers.pids

    def _guarded(self, fn, *args):
        self.workers.check()
        if self.workers.in_step:
            raise RuntimeError("a step was interrupted on rank 0 while the workers ran it; the tensor-parallel "
                               "engine cannot continue, create a new LLM")
        self.workers.in_step = True
        try:
            result = fn(*args)
        except BaseException as exc:
            error = self.workers.error_for(exc)
            if error is not None:
                raise error from exc
            raise
        self.workers.in_step = False
        self.workers.check()  # a worker that died during the step (NCCL aborted): its results are void
        return result

    def execute_model(self, out):
        output = self._guarded(self.model_runner.execute_model, out)
        self.workers.check()
        return output

    def launch(self, out, prev_token_ids: torch.Tensor | None = None):
        return self._guarded(self.model_runner.launch, out, prev_token_ids)

    def collect(self, handle):
        output = self.model_runner.collect(handle)
        self.workers.check()
        return output

    def shutdown(self):
        """Stop the workers (they free their own devices as they exit), then free rank 0's."""
        self._finalizer()
        self.model_runner.shutdown()
