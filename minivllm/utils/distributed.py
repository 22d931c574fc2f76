"""Tensor-parallel helpers that degrade to no-ops at tensor-parallel size 1.

Layers take `tp_rank`/`tp_size` explicitly; collectives run only when a process group exists and the
size is > 1, so a single-GPU or CPU engine never needs torch.distributed initialised.
vLLM: vllm/distributed/communication_op.py.
"""
import torch
import torch.distributed as dist


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    if tp_size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Concatenate each rank's shard of the last dimension (the vocab shards of the LM head)."""
    if tp_size == 1:
        return x
    shards = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(shards, x)
    return torch.cat(shards, dim=-1)
