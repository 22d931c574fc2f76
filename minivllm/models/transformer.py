"""The Llama-family decoder shared by Llama and Qwen3: pre-norm blocks of GQA attention and SwiGLU.

The model files (llama.py, qwen3.py) only say how they differ (Qwen3 normalises q and k per head).
Module names follow the Hugging Face checkpoints so the loader can map tensor names directly.
vLLM: vllm/model_executor/models/llama.py (which Qwen2/Qwen3 build on as well).
"""
import torch
from torch import nn

from minivllm.layers.activation import SiluAndMul
from minivllm.layers.attention import Attention
from minivllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.layernorm import RMSNorm
from minivllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minivllm.layers.rotary_embedding import RotaryEmbedding, check_rope_scaling, rope_theta_of


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):
    def __init__(self, config, rotary_emb, qk_norm: bool, attention_backend: str, tp_rank: int, tp_size: int,
                 quant_config=None):
        super().__init__()
        self.head_dim = head_dim_of(config)
        tp = dict(tp_rank=tp_rank, tp_size=tp_size, quant_config=quant_config)
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias, **tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias, **tp)
        self.rotary_emb = rotary_emb  # one cos/sin table shared by every layer
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, attention_backend)
        if qk_norm:  # Qwen3: RMSNorm over each head's vector before RoPE
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        # q/k norm (Qwen3), RoPE and the KV-cache store are one fused kernel inside the attention layer
        norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else ()
        out = self.attn.forward_qkv(qkv, positions, self.rotary_emb.cos_sin_cache, *norm)
        return self.o_proj(out.flatten(1, 2))  # out: [num_tokens, num_heads, head_dim]


class DecoderMLP(nn.Module):
    def __init__(self, config, tp_rank: int, tp_size: int, compile_small_ops: bool = True, quant_config=None):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        bias = getattr(config, "mlp_bias", False)
        tp = dict(tp_rank=tp_rank, tp_size=tp_size, quant_config=quant_config)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=bias, **tp)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias, **tp)
        self.act_fn = SiluAndMul(compile_small_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config, rotary_emb, qk_norm: bool, attention_backend: str, tp_rank: int, tp_size: int,
                 compile_small_ops: bool = True, quant_config=None):
        super().__init__()
        self.self_attn = DecoderAttention(config, rotary_emb, qk_norm, attention_backend, tp_rank, tp_size, quant_config)
        self.mlp = DecoderMLP(config, tp_rank, tp_size, compile_small_ops, quant_config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, compile_small_ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, compile_small_ops)

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
    def __init__(self, config, qk_norm: bool, attention_backend: str, tp_rank: int, tp_size: int,
                 compile_small_ops: bool = True, quant_config=None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        check_rope_scaling(config)
        rotary_emb = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, rope_theta_of(config))
        self.layers = nn.ModuleList(DecoderLayer(config, rotary_emb, qk_norm, attention_backend, tp_rank, tp_size,
                                                 compile_small_ops, quant_config)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, compile_small_ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DecoderForCausalLM(nn.Module):
    """A decoder-only LM. Subclasses set `qk_norm`.

    forward(input_ids [num_tokens], positions [num_tokens]) -> hidden states [num_tokens, hidden];
    compute_logits(hidden states [n, hidden]) -> logits [n, vocab].
    quant_config: FP8 weights for every linear layer of the decoder (layers/quantization.py); the
    embeddings and the LM head stay in the model's dtype.
    """

    qk_norm = False
    # checkpoint name fragment -> (our packed parameter fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, attention_backend: str = "torch", tp_rank: int = 0, tp_size: int = 1,
                 compile_small_ops: bool = True, quant_config=None):
        """compile_small_ops: the engine option (CUDA): RMSNorm through torch.compile, SiLU-and-mul
        through its Triton kernel; False runs both as plain PyTorch ops. quant_config: see the class
        docstring."""
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.qk_norm, attention_backend, tp_rank, tp_size, compile_small_ops,
                                  quant_config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)
