"""Token embedding and LM head, split over the vocabulary for tensor parallelism.

Rank r holds vocab rows [r * V/tp, (r+1) * V/tp); ids outside that range embed to zero on that rank
and the all-reduce fills them in. The LM head computes the logits of this rank's vocab rows; rank 0,
which samples, gathers them into the full vocabulary. vLLM: vllm/model_executor/layers/vocab_parallel_embedding.py.
"""
import torch
import torch.nn.functional as F
from torch import nn

from minivllm.layers.context import ModelContext
from minivllm.layers.linear import _copy_checked, _divide
from minivllm.utils.distributed import all_reduce, gather_last_dim


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, ctx: ModelContext = ModelContext()):
        super().__init__()
        tp_rank, tp_size = ctx.tp_rank, ctx.tp_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = _divide(num_embeddings, tp_size)
        self.vocab_start = tp_rank * self.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = ""):
        shard = loaded.narrow(0, self.vocab_start, self.num_embeddings_per_partition) if self.tp_size > 1 else loaded
        _copy_checked(param.data, shard, name)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_range = (local >= 0) & (local < self.num_embeddings_per_partition)
        y = F.embedding(local.clamp(0, self.num_embeddings_per_partition - 1), self.weight)
        return all_reduce(y * in_range.unsqueeze(-1), self.tp_size)


def float32_logits(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden @ weight^T, stored in float32 whatever the model's dtype.

    Rounded to bfloat16 (steps of 1/8 between 16 and 32), two close logits become one: SmolLM2 on
    "What is the capital of France?" scores "The" 25.33 and "L" 25.24 in float32, both 25.5 once
    rounded, and greedy answered "L'Étoile, ..." instead of "The capital of France is Paris.".
    The GEMM accumulates in float32 anyway; on CUDA only its store changes (torch.mm's out_dtype).
    On the CPU a half-precision model's hidden states and head are cast to float32 first."""
    if hidden_states.dtype == torch.float32:
        return F.linear(hidden_states, weight)
    if hidden_states.is_cuda:
        return torch.mm(hidden_states, weight.t(), out_dtype=torch.float32)
    return F.linear(hidden_states.float(), weight.float())


class ParallelLMHead(VocabParallelEmbedding):
    """float32 logits = hidden @ W^T over this rank's vocab shard, gathered to the full vocabulary on
    rank 0 (the other ranks return None)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return gather_last_dim(float32_logits(hidden_states, self.weight), self.tp_size)
