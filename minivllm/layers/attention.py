"""The attention layer: store this step's K/V in the paged cache, then attend, via a pluggable backend.

A backend is the trio of flash-attn-style functions (store_kvcache, flash_attn_varlen_func,
flash_attn_with_kvcache). The `torch` backend runs the naive references in kernels/, the
`triton` backend the Triton kernels beside them: same signatures, so switching is one name.
An FP8 KV cache (kv_cache_dtype="fp8") is written and read with this layer's per-tensor k_scale and
v_scale: the store kernels quantize, the attention kernels dequantize (kernels/quant_fp8.py).
vLLM: vllm/attention/layer.py and vllm/v1/attention/backends/.
"""
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from minivllm.utils.context import get_forward_context, get_piece_capture


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    store_kvcache: Callable
    flash_attn_varlen_func: Callable
    flash_attn_with_kvcache: Callable
    qk_norm_rope_store: Callable


def get_attention_backend(name: str) -> AttentionBackend:
    from minivllm import kernels

    if name == "torch":
        return AttentionBackend("torch", kernels.store_kvcache_ref, kernels.flash_attn_varlen_ref,
                                kernels.flash_attn_with_kvcache_ref, kernels.qk_norm_rope_store_ref)
    if name == "triton":
        return AttentionBackend("triton", kernels.store_kvcache, kernels.flash_attn_varlen_func,
                                kernels.flash_attn_with_kvcache, kernels.qk_norm_rope_store)
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'triton'")


class Attention(nn.Module):
    """Causal multi-head attention with grouped KV heads over the paged KV cache.

    `k_cache`/`v_cache` ([num_blocks, block_size, num_kv_heads, head_dim]) are assigned by the
    ModelRunner; while they are empty (parity tests) attention runs on this step's K/V alone.
    With an FP8 cache the runner also assigns `k_scale`/`v_scale` ([1] float32 device tensors,
    updated in place, so captured CUDA graphs read the current values) and may set
    `calculate_kv_scales`: the next prefill then sets both scales from its own K/V (amax / 448).
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, backend: str = "torch"):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads, self.scale = num_heads, head_dim, num_kv_heads, scale
        self.backend = get_attention_backend(backend)
        self.k_cache = self.v_cache = torch.tensor([])
        self.k_scale: torch.Tensor | None = None  # FP8 cache only: stored value = k / k_scale
        self.v_scale: torch.Tensor | None = None
        self.calculate_kv_scales = False

    def forward_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                    q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                    eps: float = 1e-6) -> torch.Tensor:
        """Attention from the QKV projection's output: per-head RMSNorm of q and k (when weights are
        given), RoPE and the KV-cache store run as one fused kernel (kernels/qk_norm_rope.py).

        qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]; returns [num_tokens, num_heads, head_dim].
        """
        meta = get_forward_context()
        fused_store = self.k_cache.numel() and not (self.calculate_kv_scales and meta.is_prefill)
        cache = {}
        if fused_store:
            cache = dict(k_cache=self.k_cache, v_cache=self.v_cache, slot_mapping=meta.slot_mapping,
                         k_scale=self.k_scale, v_scale=self.v_scale)
        q, k, v = self.backend.qk_norm_rope_store(qkv, positions, cos_sin_cache, self.num_heads, self.num_kv_heads,
                                                  q_norm_weight, k_norm_weight, eps, **cache)
        if self.k_cache.numel() and not fused_store:  # the scales come from this K/V: store after
            self._store_with_new_scales(k, v, meta)
        capture = get_piece_capture()
        if capture is not None:  # capturing a prompt step's pieces: attention runs between them, eagerly
            return capture.cut(self, q, k, v)
        return self._attend(q, k, v, meta)

    def _store_with_new_scales(self, k, v, meta):
        """Store this step's K/V; first, when asked to and in a prefill, set the FP8 scales from them."""
        if self.calculate_kv_scales and meta.is_prefill:
            from minivllm.kernels.quant_fp8 import kv_scale_from_amax

            self.k_scale.copy_(kv_scale_from_amax(k))
            self.v_scale.copy_(kv_scale_from_amax(v))
            self.calculate_kv_scales = False
        self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)

    def _descales(self) -> dict:
        """The attention kernels' FP8 arguments for reading the cache (none for a cache in the
        model's dtype). Keys of this step that attention takes straight from the projection are
        not quantized and take none."""
        return {} if self.k_scale is None else dict(k_descale=self.k_scale, v_descale=self.v_scale)

    def _attend(self, q, k, v, meta):
        if not meta.is_prefill:
            return self._decode(q, meta)
        # A mixed step: decode rows through the decode kernel, prompt chunks through the prefill
        # kernel (each is tuned for its shape: one query row vs many). A unified mixed step packed its
        # decode rows as 1-token chunks (num_decode_tokens 0): one prefill launch (model_runner.py).
        num_decodes = meta.num_decode_tokens
        out = self._prefill(q[num_decodes:], k[num_decodes:], v[num_decodes:], meta)
        if num_decodes:
            out = torch.cat([self._decode(q[:num_decodes], meta.decode), out])
        return out

    def _prefill(self, q, k, v, meta):
        cache = {}
        if meta.block_tables is not None:  # a chunk continues a cached prefix: it lives only in the cache
            cache = dict(block_table=meta.block_tables, k_cache=self.k_cache, v_cache=self.v_cache,
                         **self._descales())
        return self.backend.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k, softmax_scale=self.scale,
            causal=True, **cache)

    def _decode(self, q, meta):
        out = self.backend.flash_attn_with_kvcache(
            q.unsqueeze(1), self.k_cache, self.v_cache, cache_seqlens=meta.context_lens,
            block_table=meta.block_tables, softmax_scale=self.scale, causal=True, seq_order=meta.seq_order,
            **self._descales())
        return out.squeeze(1)
