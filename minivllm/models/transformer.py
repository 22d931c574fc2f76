"""The Llama-family decoder shared by Llama, Qwen2, Qwen3 and Qwen3-MoE: pre-norm blocks of GQA
attention and SwiGLU.

The model files only say how they differ: Qwen3 normalises q and k per head (`qk_norm`), Qwen2 has
biases on q, k and v (`qkv_bias`), Qwen3-MoE puts a mixture of experts in place of some layers'
MLP (the `make_mlp` hook).
Module names follow the Hugging Face checkpoints so the loader can map tensor names directly.
Every layer is built with the model's config and a ModelContext (tensor-parallel place,
quantization: layers/context.py).
vLLM: vllm/model_executor/models/llama.py (which Qwen2/Qwen3 build on as well).
"""
import torch
from torch import nn

from minivllm.core.attention import Attention
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.context import ModelContext
from minivllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.layernorm import RMSNorm
from minivllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minivllm.layers.rotary_embedding import RotaryEmbedding, check_rope_scaling, rope_theta_of


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_no_sliding_window(config):
    """Every layer here attends to the whole sequence: a config that asks for a sliding window is refused."""
    sliding_window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", False) and sliding_window is not None:
        raise ValueError(f"use_sliding_window=True (sliding_window={sliding_window}) is not supported: minivllm's "
                         "attention is full causal attention over the whole sequence")


class DecoderAttention(nn.Module):
    def __init__(self, config, rotary_emb: RotaryEmbedding, qk_norm: bool, ctx: ModelContext,
                 qkv_bias: bool | None = None):
        """qkv_bias: biases on q, k and v only (Qwen2); None: the config's attention_bias, on q, k, v and o."""
        super().__init__()
        self.head_dim = head_dim_of(config)
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias if qkv_bias is None else qkv_bias,
                                          ctx=ctx)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias,
                                        ctx=ctx)
        self.rotary_emb = rotary_emb  # one cos/sin table shared by every layer
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)
        self.qk_norm = qk_norm
        if qk_norm:  # Qwen3: RMSNorm over each head's vector before RoPE
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.forward_qkv(positions, self.qkv_proj(hidden_states))

    def forward_qkv(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Attention from the projections: qkv [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]."""
        q, k, v = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v)  # stores k, v in the paged cache, then attends: [num_tokens, num_heads, head_dim]
        return self.o_proj(out.flatten(1, 2))


class DecoderMLP(nn.Module):
    def __init__(self, config, ctx: ModelContext):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=bias,
                                                       ctx=ctx)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias, ctx=ctx)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config, rotary_emb: RotaryEmbedding, qk_norm: bool, ctx: ModelContext, mlp: nn.Module,
                 qkv_bias: bool | None = None):
        super().__init__()
        self.self_attn = DecoderAttention(config, rotary_emb, qk_norm, ctx, qkv_bias)
        self.mlp = mlp  # DecoderMLP, or any module of [num_tokens, hidden] -> [num_tokens, hidden]
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual):
        """The residual stream is carried separately so each RMSNorm can fuse the add."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class DecoderModel(nn.Module):
    def __init__(self, config, qk_norm: bool, ctx: ModelContext, make_mlp, qkv_bias: bool | None = None):
        """make_mlp(config, layer_idx, ctx): layer layer_idx's MLP module (DecoderForCausalLM.make_mlp)."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx)
        check_rope_scaling(config)
        rotary_emb = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, rope_theta_of(config))
        self.layers = nn.ModuleList(DecoderLayer(config, rotary_emb, qk_norm, ctx, make_mlp(config, i, ctx), qkv_bias)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DecoderForCausalLM(nn.Module):
    """A decoder-only LM. Subclasses set `qk_norm` and `qkv_bias`, and may override `make_mlp`.

    forward(input_ids [num_tokens], positions [num_tokens]) -> hidden states [num_tokens, hidden];
    compute_logits(hidden states [n, hidden]) -> float32 logits [n, vocab] (None on tensor-parallel
    ranks other than 0). The embeddings and the LM head stay in the model's dtype whatever the
    linear layers' quantization.
    """

    qk_norm = False
    qkv_bias = None  # None: the config's attention_bias (q, k, v and o); True: on q, k and v only (Qwen2)
    # checkpoint name fragment -> (our packed parameter fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, ctx: ModelContext = ModelContext()):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.qk_norm, ctx, self.make_mlp, self.qkv_bias)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ctx)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp(self, config, layer_idx: int, ctx: ModelContext) -> nn.Module:
        """Layer `layer_idx`'s MLP: the dense SwiGLU MLP here; Qwen3-MoE returns a sparse MoE block in
        most layers."""
        return DecoderMLP(config, ctx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)
