"""Mixture of experts: each token runs through `top_k` of `num_experts` SwiGLU MLPs, and their
outputs are summed, weighted by the router's probabilities.

Every expert's weights live in two packed parameters, as in vLLM:

    w13_weight [num_experts, 2 * N, hidden]   each expert's rows: | gate (w1): N | up (w3): N |
    w2_weight  [num_experts, hidden, N]       down

N is this rank's share of moe_intermediate_size: under tensor parallelism every rank holds a slice of
every expert (no expert parallelism), and the layer's output is all-reduced like a RowParallelLinear's.
`fused_moe_ref` is the plain PyTorch path; on CUDA the engine swaps in the Triton kernel
(kernels/fused_moe.py, via engine/fused_ops.py).
vLLM: vllm/model_executor/layers/fused_moe/layer.py (FusedMoE) and fused_moe.py (fused_topk).
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.layers.activation import silu_and_mul
from minivllm.layers.context import ModelContext
from minivllm.layers.linear import _copy_checked
from minivllm.utils.distributed import all_reduce


def fused_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [num_tokens, num_experts] -> (topk_weights [num_tokens, top_k] float32, topk_ids
    [num_tokens, top_k] int32): the softmax in float32 over all experts, then the top k; renormalize:
    the k weights divided by their sum (Qwen3-MoE's norm_topk_prob)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = probs.topk(top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids.to(torch.int32)


def fused_moe_ref(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """sum over each token's top-k experts e of weight_e * down_e(silu(gate_e x) * up_e x).

    hidden_states [M, K], w13 [E, 2N, K], w2 [E, K, N], topk_weights [M, top_k] float32, topk_ids
    [M, top_k] int32 -> [M, K] in hidden_states' dtype (summed in float32).

    Every expert runs on every token, weighted by that token's routing weight for it (zero where the
    token did not pick it): E / top_k times the FLOPs of the routed products. We pay that for two
    things. It is the definition, with nothing to get wrong. And no shape depends on the routing, so
    there is no host sync (the gather-per-expert alternative needs `nonzero`, whose size the host must
    read before launching the expert's GEMM) and the path can be captured in a CUDA graph. It runs on
    the CPU (tiny models, where the extra FLOPs cost little); on CUDA the engine swaps in the Triton
    kernel, which computes only the routed (token, expert) pairs.
    """
    num_tokens, num_experts = hidden_states.shape[0], w13.shape[0]
    # [M, E]: expert e's weight for each token, zero for the experts the token did not pick
    expert_weights = torch.zeros(num_tokens, num_experts, dtype=torch.float32, device=hidden_states.device)
    expert_weights.scatter_(1, topk_ids.long(), topk_weights)
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float32, device=hidden_states.device)
    for e in range(num_experts):
        expert_out = F.linear(silu_and_mul(F.linear(hidden_states, w13[e])), w2[e])  # [M, K]
        out += expert_weights[:, e, None] * expert_out.float()
    return out.to(hidden_states.dtype)


@dataclass(frozen=True)
class ExpertWeight:
    """Where one checkpoint tensor of a layer's experts goes (an entry of `expert_params_mapping`)."""

    param_name: str  # the FusedMoE parameter, below the layer's module: "experts.w13_weight" or "experts.w2_weight"
    expert_id: int | None  # None: the tensor holds every expert (the fused layout)
    shard_id: str  # "w1" gate, "w3" up, "w2" down; "w13" gate and up stacked (the fused layout)
    fills: tuple  # the (expert_id, shard_id) pieces of the parameter it fills: what the loader checks off


def make_expert_params_mapping(num_experts: int) -> dict[str, ExpertWeight]:
    """Checkpoint name, from `experts.` on -> where it goes. Two layouts of the same weights (N, K:
    moe_intermediate_size, hidden_size):

        per expert (the hub's; transformers' save_pretrained writes it)
            experts.{e}.gate_proj.weight [N, K], experts.{e}.up_proj.weight [N, K],
            experts.{e}.down_proj.weight [K, N]
        fused (transformers >= 5 in memory; save_pretrained(save_original_format=False) writes it)
            experts.gate_up_proj [E, 2N, K] (gate rows, then up rows), experts.down_proj [E, K, N]
    """
    mapping = {}
    for e in range(num_experts):
        for name, param, shard_id in (("gate_proj", "w13", "w1"), ("up_proj", "w13", "w3"), ("down_proj", "w2", "w2")):
            mapping[f"experts.{e}.{name}.weight"] = ExpertWeight(f"experts.{param}_weight", e, shard_id,
                                                                 ((e, shard_id),))
    experts = range(num_experts)
    mapping["experts.gate_up_proj"] = ExpertWeight("experts.w13_weight", None, "w13",
                                                   tuple((e, s) for e in experts for s in ("w1", "w3")))
    mapping["experts.down_proj"] = ExpertWeight("experts.w2_weight", None, "w2", tuple((e, "w2") for e in experts))
    return mapping


class FusedMoE(nn.Module):
    """The experts of one sparse MoE block: forward(hidden_states [num_tokens, hidden], router_logits
    [num_tokens, num_experts]) -> [num_tokens, hidden], summed over the tensor-parallel ranks."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 ctx: ModelContext = ModelContext()):
        """intermediate_size: each expert's, all ranks' (moe_intermediate_size); renormalize: norm_topk_prob."""
        super().__init__()
        if ctx.quant_config is not None:
            raise NotImplementedError("FP8 weights for a mixture-of-experts model are not supported: FusedMoE has no "
                                      "FP8 path (load the model unquantized)")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.tp_rank, self.tp_size = ctx.tp_rank, ctx.tp_size
        if intermediate_size % ctx.tp_size:
            raise ValueError(f"tensor_parallel_size={ctx.tp_size} does not divide the experts' moe_intermediate_size="
                             f"{intermediate_size} (each rank holds an equal slice of every expert)")
        self.intermediate_size_per_partition = n = intermediate_size // ctx.tp_size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * n, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, n), requires_grad=False)
        self.w13_weight.weight_loader = self.w2_weight.weight_loader = self.weight_loader
        self.fused_moe_fn = fused_moe_ref  # the engine swaps in the Triton kernel on CUDA (engine/fused_ops.py)

    def weight_loader(self, param: nn.Parameter, loaded, name: str, expert_id: int | None, shard_id: str):
        """Copy a checkpoint tensor (or a lazily read slice of one: models/loader.py's CheckpointSlice)
        into its place in `param`; this rank reads only its N of moe_intermediate_size.

        expert_id None: `loaded` holds every expert (the fused layout), [E, ...] in front."""
        n, n_full, k = self.intermediate_size_per_partition, self.intermediate_size, self.hidden_size
        per_expert = {"w1": (n_full, k), "w3": (n_full, k), "w13": (2 * n_full, k), "w2": (k, n_full)}[shard_id]
        full_shape = per_expert if expert_id is not None else (self.num_experts, *per_expert)
        if tuple(loaded.shape) != full_shape:
            raise ValueError(f"shape mismatch for {name}: checkpoint has {tuple(loaded.shape)}, "
                             f"the model expects {full_shape}")
        target = param.data if expert_id is None else param.data[expert_id]
        rows = target.dim() - 2  # the dimension of an expert's rows (1 with experts in front)
        start = self.tp_rank * n
        if shard_id == "w2":  # [..., K, N_full]: this rank's columns
            _copy_checked(target, loaded.narrow(rows + 1, start, n), name)
        elif shard_id == "w13":  # [E, 2 * N_full, K]: this rank's gate rows, then its up rows
            _copy_checked(target.narrow(rows, 0, n), loaded.narrow(rows, start, n), name)
            _copy_checked(target.narrow(rows, n, n), loaded.narrow(rows, n_full + start, n), name)
        else:  # w1 (gate) or w3 (up) [N_full, K]: this rank's rows, into the first or the second half
            _copy_checked(target.narrow(rows, 0 if shard_id == "w1" else n, n), loaded.narrow(rows, start, n), name)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = fused_topk(router_logits, self.top_k, self.renormalize)  # [num_tokens, top_k]
        out = self.fused_moe_fn(hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        # each rank summed its slice of every expert's intermediate dimension: add the partial sums
        return all_reduce(out, self.tp_size)
