"""Qwen3-MoE: Qwen3's decoder with a sparse mixture of experts in place of the MLP in most layers.

Layer i is sparse unless it is listed in `mlp_only_layers` or (i + 1) is not a multiple of
`decoder_sparse_step` (transformers' Qwen3MoeDecoderLayer decides the same way); a sparse block's
router (`mlp.gate`) sends each token to `num_experts_per_tok` of `num_experts` SwiGLU experts
(layers/fused_moe.py). The dense layers are the Llama-family MLP of models/transformer.py.
vLLM: vllm/model_executor/models/qwen3_moe.py.
"""
import torch
from torch import nn

from minivllm.layers.context import ModelContext
from minivllm.layers.fused_moe import FusedMoE, make_expert_params_mapping
from minivllm.layers.linear import ReplicatedLinear
from minivllm.models.transformer import DecoderForCausalLM, DecoderMLP, check_no_sliding_window


def is_sparse_layer(config, layer_idx: int) -> bool:
    return (layer_idx not in (config.mlp_only_layers or []) and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config, ctx: ModelContext):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        # the router is small and every rank needs all of its logits: replicated, in the model's dtype
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False,
                                     ctx=ModelContext(ctx.tp_rank, ctx.tp_size))
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, config.norm_topk_prob, ctx)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(hidden_states)  # [num_tokens, num_experts]
        return self.experts(hidden_states, router_logits)


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    qk_norm = True

    def __init__(self, config, ctx: ModelContext = ModelContext()):
        check_no_sliding_window(config)
        super().__init__(config, ctx)
        # checkpoint name from `experts.` on -> which FusedMoE parameter, expert and shard (models/loader.py)
        self.expert_params_mapping = make_expert_params_mapping(config.num_experts)

    def make_mlp(self, config, layer_idx: int, ctx: ModelContext) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return Qwen3MoeSparseMoeBlock(config, ctx)
        return DecoderMLP(config, ctx)
