"""Tensor parallelism on torch.distributed: the rendezvous, the collectives the layers call, and the
process group every rank joins (NCCL on CUDA, gloo on the CPU).

Layers take `tp_rank`/`tp_size` explicitly and call `all_reduce` / `gather_last_dim`: at size 1 these
return at once, so a single-device engine never initialises torch.distributed and pays nothing.
vLLM: vllm/distributed/parallel_state.py and vllm/distributed/communication_op.py.
"""
import contextlib
import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Collectives inside a step finish in milliseconds; this bounds a wait on a rank that hangs.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
# The step-message group: an idle engine's workers wait on it for as long as the engine lives.
IDLE_TIMEOUT = datetime.timedelta(days=365)


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum `x` over the tensor-parallel ranks, in place (row-parallel outputs, the embedding)."""
    if tp_size > 1:
        dist.all_reduce(x)
    return x


def gather_last_dim(x: torch.Tensor, tp_size: int) -> torch.Tensor | None:
    """Concatenate every rank's shard of the last dimension on rank 0 (the LM head's vocab shards):
    only rank 0 samples, so the other ranks send their logits and get None back."""
    if tp_size == 1:
        return x
    x = x.contiguous()
    if dist.get_rank() != 0:
        dist.gather(x, None, dst=0)
        return None
    shards = [torch.empty_like(x) for _ in range(tp_size)]
    dist.gather(x, shards, dst=0)
    return torch.cat(shards, dim=-1)


def all_reduce_min(value: int, device: torch.device) -> int:
    """The smallest `value` over all ranks (the KV-cache block count every rank can hold)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


# ----------------------------------------------------------------------------- rendezvous

@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: rank 0 serves torch.distributed's TCP store at addr:port."""

    addr: str
    port: int

    @property
    def init_method(self) -> str:
        return f"tcp://{self.addr}:{self.port}"

    @classmethod
    def from_env(cls) -> "Rendezvous":
        """torch.distributed's conventions: MASTER_ADDR (default 127.0.0.1) and MASTER_PORT (default:
        a port the OS reports free, so two engines on one host never collide)."""
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = os.environ.get("MASTER_PORT")
        return cls(addr, int(port) if port else free_port())


def free_port() -> int:
    """A TCP port no one listens on now (the OS picks it; rank 0 binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def device_for_rank(device: str, rank: int) -> torch.device:
    """Rank r drives GPU r of its host (`device` names the type: "cuda" or "cpu")."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.device("cuda", rank if device.index is None else device.index + rank)
    return device


@contextlib.contextmanager
def _nccl_errors_left_to_the_engine(rank: int):
    """On rank 0 (the caller's process), NCCL's own watchdog must not tear the process down when a
    worker dies: the executor's watchdog reports it as an error and aborts the communicator. The
    setting is read when the process group is built; a value the user set is kept."""
    name = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    if rank != 0 or name in os.environ:
        yield
        return
    os.environ[name] = "0"
    try:
        yield
    finally:
        del os.environ[name]


@dataclass
class TPGroup:
    """This process's place in the tensor-parallel group.

    The model's collectives run on the default (world) group: NCCL on CUDA, gloo on the CPU. The
    per-step messages from rank 0 travel on `control`, a gloo group, so that they are host tensors
    (a worker reads the step's shape before it allocates anything on its device)."""

    rank: int
    size: int
    device: torch.device
    control: object  # the gloo ProcessGroup of the step messages

    @classmethod
    def join(cls, rendezvous: Rendezvous, rank: int, size: int, device: torch.device) -> "TPGroup":
        """Join the group (blocks until every rank has joined)."""
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process: one tensor-parallel "
                               "engine per process at a time (shut the other one down first)")
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        with _nccl_errors_left_to_the_engine(rank):
            dist.init_process_group(backend, init_method=rendezvous.init_method, rank=rank, world_size=size,
                                    timeout=COLLECTIVE_TIMEOUT)
        control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        return cls(rank, size, device, control)

    def leave(self):
        if dist.is_initialized():
            dist.destroy_process_group()
