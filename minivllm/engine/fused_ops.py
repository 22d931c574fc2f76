"""Fused kernels for the small ops between the GEMMs: a ModelRunner layer that swaps them in after
the model is built.

    attention's prologue   q/k RMSNorm (Qwen3) + RoPE + the KV-cache store, one Triton kernel per
                           layer (kernels/qk_norm_rope.py) instead of five small ones: with the
                           `triton` attention backend, on any device
    RMSNorm (+ residual)   one torch.compile'd kernel each               } CUDA, compile_small_ops
    SiLU-and-mul           one Triton kernel (kernels/silu_and_mul.py)   } (also RoPE, where the
                                                                         }  prologue is not fused)
    mixture of experts     the Triton fused_moe kernel (kernels/fused_moe.py), on CUDA: the plain
                           path runs every expert on every token (layers/fused_moe.py)

Unfused, a decode step of a 28-layer model launches over a thousand tiny kernels. The model's own
forward stays the plain, readable one (models/transformer.py); `FusedDecoderAttention` is that
module with its prologue replaced. vLLM fuses the same ops in its compiled graphs (vllm/compilation/).
"""
from minivllm.core.attention import get_forward_context
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.fused_moe import FusedMoE
from minivllm.layers.layernorm import RMSNorm, add_rms_norm, rms_norm
from minivllm.layers.rotary_embedding import RotaryEmbedding, apply_rotary
from minivllm.models.transformer import DecoderAttention
from minivllm.utils.compile import compile_on_cuda

compiled_rms_norm = compile_on_cuda(rms_norm)
compiled_add_rms_norm = compile_on_cuda(add_rms_norm)
compiled_apply_rotary = compile_on_cuda(apply_rotary)


def silu_and_mul_kernel(x):
    from minivllm.kernels import silu_and_mul

    return silu_and_mul(x)


def fused_moe_kernel(hidden_states, w13, w2, topk_weights, topk_ids):
    from minivllm.kernels.fused_moe import fused_moe

    return fused_moe(hidden_states, w13, w2, topk_weights, topk_ids)


class FusedDecoderAttention(DecoderAttention):
    """DecoderAttention whose q/k norms, RoPE and KV-cache store run as one kernel; attention then
    reads the cache the kernel wrote."""

    def forward_qkv(self, positions, qkv):
        from minivllm.kernels import qk_norm_rope_store

        attn = self.attn
        cache = {}
        if attn.k_cache.numel():
            cache = dict(k_cache=attn.k_cache, v_cache=attn.v_cache, slot_mapping=get_forward_context().slot_mapping,
                         k_scale=attn.k_scale, v_scale=attn.v_scale)
        norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else ()
        q, k, v = qk_norm_rope_store(qkv, positions, self.rotary_emb.cos_sin_cache, self.num_heads,
                                     self.num_kv_heads, *norm, **cache)
        return self.o_proj(attn.attend(q, k, v).flatten(1, 2))  # attend: [num_tokens, num_heads, head_dim]


def fuse_small_ops(model, on_cuda: bool, compile_small_ops: bool, fuse_attention_prologue: bool):
    """Swap the fused ops into a built model, in place."""
    for module in model.modules():
        if isinstance(module, DecoderAttention) and fuse_attention_prologue:
            module.__class__ = FusedDecoderAttention  # same module, same weights; another forward
        if isinstance(module, FusedMoE) and on_cuda:  # the experts' GEMMs, not a small op: whatever compile_small_ops
            module.fused_moe_fn = fused_moe_kernel
        if not (on_cuda and compile_small_ops):
            continue
        if isinstance(module, RMSNorm):
            module.rms_norm_fn, module.add_rms_norm_fn = compiled_rms_norm, compiled_add_rms_norm
        elif isinstance(module, SiluAndMul):
            module.silu_and_mul_fn = silu_and_mul_kernel
        elif isinstance(module, RotaryEmbedding):
            module.apply_rotary_fn = compiled_apply_rotary


class FusedOps:
    """ModelRunner layer: the model with its small ops fused (`load_model`)."""

    def load_model(self):
        model = super().load_model()
        fuse_small_ops(model, self.device.type == "cuda", self.config.compile_small_ops,
                       self.config.attention_backend == "triton")
        return model
