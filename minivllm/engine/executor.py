"""The executor: what runs a scheduled step on the model, on one device or on several ranks.

The engine calls `launch` / `collect` / `run` and never learns how many ranks there are. With
tensor_parallel_size = N, rank 0 lives in the caller's process (it also samples) and ranks 1..N-1
are worker processes; every step, rank 0 sends a typed `StepMessage` and all ranks run their shard:

    rank 0 (engine process)                          rank r (worker process)
    prepare inputs -> StepMessage.header --gloo-->   receive header
                      step tensors --broadcast-->    receive tensors (device to device on CUDA)
    forward (all-reduces) <----------------------->  forward (all-reduces)
    LM head shard, gather logits <-----------------  LM head shard
    sample

vLLM: vllm/v1/executor/abstract.py, uniproc_executor.py, multiproc_executor.py.
"""
import logging
import multiprocessing.connection
import os
import signal
import threading
import time
import weakref
from dataclasses import astuple, dataclass
from enum import IntEnum

import torch
import torch.distributed as dist
import torch.multiprocessing

from minivllm.config import Config
from minivllm.engine.model_runner import ModelRunner
from minivllm.utils.context import AttentionMetadata
from minivllm.utils.distributed import Rendezvous, TPGroup, device_for_rank

logger = logging.getLogger("minivllm")

WORKER_EXIT_TIMEOUT_S = 10.0  # a worker told to stop has this long before it is killed


def create_executor(config: Config):
    """One device: the ModelRunner itself. Several: rank 0 here, the other ranks in worker processes."""
    if config.tensor_parallel_size == 1:
        return UniProcExecutor(config)
    return MultiprocExecutor(config)


class UniProcExecutor:
    """A single device: the runner's own methods, so a step costs nothing more than it did."""

    def __init__(self, config: Config):
        self.model_runner = ModelRunner(config)
        self.launch, self.collect, self.run = self.model_runner.launch, self.model_runner.collect, self.model_runner.run

    def shutdown(self):
        self.model_runner.shutdown()


# ----------------------------------------------------------------------------- the step message

class StepKind(IntEnum):
    PREFILL = 1
    DECODE = 2
    SHUTDOWN = 3


@dataclass
class StepMessage:
    """What rank 0 tells the other ranks before each step, as a few integers. The step's tensors
    follow in one broadcast: a decode's whole static input buffer (cuda_graph.DecodeBuffers), which
    the workers' captured graphs read in place, or a prefill's (or mixed step's) packed int64 parts:

        input_ids | positions | slot_mapping            num_tokens each
        cu_seqlens_q | cu_seqlens_k                     num_chunks + 1 each (num_chunks = num_seqs - num_decodes)
        block_tables                                    num_chunks x block_table_width (0: no cached prefix)
        decode rows: context_lens | block_tables | seq_order     num_decodes x (1 | table width | 1)
        logits_rows                                     num_logits_rows: the rows rank 0 samples from
        prompt-logprob pieces                           2 x num_prompt_logprob_pieces: (first row, rows), each
                                                        one LM-head call on rank 0 (PROMPT_LOGPROBS_CHUNK rows at most)
    """

    kind: StepKind
    num_tokens: int = 0  # prefill: new tokens; decode: padded batch size
    num_seqs: int = 0
    block_table_width: int = 0  # prefill with a cached prefix: columns of block_tables (else 0)
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    num_decodes: int = 0  # a mixed step's decode rows (chunked prefill), first in the packed step
    num_logits_rows: int = 0
    num_prompt_logprob_pieces: int = 0
    num_unified_decodes: int = 0  # a unified mixed step: its first rows are decodes packed as 1-token chunks

    NUM_FIELDS = 10

    def to_tensor(self, out: torch.Tensor) -> torch.Tensor:
        out.copy_(torch.tensor(astuple(self), dtype=torch.int64))
        return out

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "StepMessage":
        kind, *rest = t.tolist()
        return cls(StepKind(kind), *rest)

    def prefill_parts(self, full_table_width: int) -> list[int]:
        """Sizes of the prefill payload's parts, in order (the class docstring)."""
        t, d = self.num_tokens, self.num_decodes
        c = self.num_seqs - d
        return [t, t, t, c + 1, c + 1, c * self.block_table_width, d, d * full_table_width, d,
                self.num_logits_rows, 2 * self.num_prompt_logprob_pieces]


class StepChannel:
    """Rank 0 `send`s each step's message and tensors; the other ranks `receive` and run them."""

    def __init__(self, group: TPGroup, runner: ModelRunner):
        self.group, self.runner = group, runner
        self._header = torch.zeros(StepMessage.NUM_FIELDS, dtype=torch.int64)  # host tensor (gloo)

    def _broadcast_header(self, message: StepMessage | None = None) -> StepMessage:
        if message is not None:
            message.to_tensor(self._header)
        dist.broadcast(self._header, src=0, group=self.group.control)
        return message or StepMessage.from_tensor(self._header)

    # ---- rank 0
    def send(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, num_seqs: int,
             logits_rows: torch.Tensor | None = None, prompt_logprob_pieces: list[tuple[int, int]] = ()):
        if not meta.is_prefill:
            self._broadcast_header(StepMessage(StepKind.DECODE, input_ids.shape[0], num_seqs))
            dist.broadcast(self.runner.decode_buffers.device, src=0)
            return
        width = 0 if meta.block_tables is None else meta.block_tables.shape[1]
        self._broadcast_header(StepMessage(StepKind.PREFILL, input_ids.shape[0], num_seqs, width, meta.max_seqlen_q,
                                           meta.max_seqlen_k, meta.num_decode_tokens, logits_rows.shape[0],
                                           len(prompt_logprob_pieces), meta.num_unified_decodes))
        parts = [input_ids, positions, meta.slot_mapping, meta.cu_seqlens_q, meta.cu_seqlens_k]
        if width:
            parts.append(meta.block_tables.flatten())
        if meta.decode is not None:
            parts += [meta.decode.context_lens, meta.decode.block_tables.flatten(), meta.decode.seq_order]
        parts.append(logits_rows)
        if prompt_logprob_pieces:
            flat = [x for piece in prompt_logprob_pieces for x in piece]
            parts.append(torch.tensor(flat, dtype=torch.int64).to(logits_rows.device))
        dist.broadcast(torch.cat([p.to(torch.int64) for p in parts]), src=0)

    def send_shutdown(self):
        self._broadcast_header(StepMessage(StepKind.SHUTDOWN))

    # ---- ranks 1..N-1
    def receive_and_run(self) -> bool:
        """Run the next step rank 0 sends; False when it says to shut down."""
        message = self._broadcast_header()
        if message.kind == StepKind.SHUTDOWN:
            return False
        if message.kind == StepKind.DECODE:
            buffers = self.runner.decode_buffers
            dist.broadcast(buffers.device, src=0)
            input_ids, positions, meta = buffers.views(message.num_tokens)
            self.runner.forward_logits(input_ids, positions, meta, message.num_seqs)
        else:
            self.runner.forward_logits(*self._receive_prefill(message))
        return True

    def _receive_prefill(self, m: StepMessage):
        full_width = self.runner.max_num_blocks_per_seq
        sizes = m.prefill_parts(full_width)
        payload = torch.empty(sum(sizes), dtype=torch.int64, device=self.runner.device)
        dist.broadcast(payload, src=0)
        (input_ids, positions, slots, cu_q, cu_k, tables, context_lens, decode_tables, seq_order, logits_rows,
         pieces) = payload.split(sizes)
        d, c = m.num_decodes, m.num_seqs - m.num_decodes
        decode = None
        if d:
            decode = AttentionMetadata(is_prefill=False, slot_mapping=None, context_lens=context_lens.int(),
                                       block_tables=decode_tables.view(d, full_width).int(), seq_order=seq_order.int())
        meta = AttentionMetadata(
            is_prefill=True, slot_mapping=slots.int(), cu_seqlens_q=cu_q.int(), cu_seqlens_k=cu_k.int(),
            max_seqlen_q=m.max_seqlen_q, max_seqlen_k=m.max_seqlen_k,
            block_tables=tables.view(c, m.block_table_width).int() if m.block_table_width else None,
            num_decode_tokens=d, decode=decode, num_unified_decodes=m.num_unified_decodes)
        # the host needs these few integers (a sync, so only when some sequence asked for prompt logprobs)
        piece_list = [tuple(piece) for piece in pieces.view(-1, 2).tolist()] if m.num_prompt_logprob_pieces else []
        return input_ids, positions, meta, m.num_seqs, logits_rows, piece_list


# ----------------------------------------------------------------------------- worker processes

def _worker_main(index: int, config: Config, rendezvous: Rendezvous, parent_pid: int):
    """Rank index + 1: join the group, build this rank's shard, run the steps rank 0 sends."""
    rank = index + 1
    # Ctrl-C in a terminal reaches every process of the group: rank 0 decides, then stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    group = TPGroup.join(rendezvous, rank, config.tensor_parallel_size, device_for_rank(config.device, rank))
    runner = ModelRunner(config, rank)
    channel = StepChannel(group, runner)
    with torch.inference_mode():
        while channel.receive_and_run():
            pass
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
                StepChannel(self.group, None).send_shutdown()
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
            self.model_runner = ModelRunner(config, rank=0)
            self.model_runner.send_step = StepChannel(self.workers.group, self.model_runner).send
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

    def launch(self, out, input_ids: torch.Tensor | None = None):
        return self._guarded(self.model_runner.launch, out, input_ids)

    def collect(self, handle) -> list[int]:
        ids = self.model_runner.collect(handle)
        self.workers.check()
        return ids

    def run(self, out) -> list[int]:
        return self.collect(self.launch(out))

    def shutdown(self):
        """Stop the workers (they free their own devices as they exit), then free rank 0's."""
        self._finalizer()
        self.model_runner.shutdown()
