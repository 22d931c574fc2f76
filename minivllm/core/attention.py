"""The attention layer: store this step's K/V in the paged cache, then attend over the cache.

Per step the ModelRunner builds one `AttentionMetadata` and sets it for the forward with
`set_forward_context`; every Attention layer reads it. How a layer stores and attends is its
`backend`: the flash-attn-style trio (store_kvcache, flash_attn_varlen_func,
flash_attn_with_kvcache) of the naive references in kernels/ (`torch`) or the Triton kernels
beside them (`triton`), same signatures, so switching is one name.
vLLM: vllm/attention/layer.py, vllm/forward_context.py, vllm/v1/attention/backends/.
"""
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass
class AttentionMetadata:
    """What attention needs to know about the tokens of one step.

    A step with prompt tokens packs the new tokens of every sequence back to back; a decode row
    of a mixed step is a sequence with one new token:

        tokens:        | seq0 new tokens | seq1 new tokens | d0 | ...
        cu_seqlens_q:  0                 5                 12   13     (new tokens, cumulative)
        cu_seqlens_k:  0                 5                 20   61     (cached + new, cumulative)

    When a sequence continues a cached prefix (a prefix hit, an earlier chunk, a decode row),
    `block_tables` is set: the prefix is read from the paged cache, the new keys from this step's
    k/v. A decode-only step has one new token per sequence and reads every key from the cache.
    """

    is_prefill: bool  # the step has prompt tokens (varlen attention); False: decode only
    slot_mapping: torch.Tensor  # [num_tokens] int32: cache slot of each new token, -1 = skip
    cu_seqlens_q: torch.Tensor | None = None  # [batch + 1] int32 (prefill)
    cu_seqlens_k: torch.Tensor | None = None  # [batch + 1] int32 (prefill)
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    block_tables: torch.Tensor | None = None  # [batch, max_blocks] int32 (decode; prefill with a prefix)
    context_lens: torch.Tensor | None = None  # [batch] int32 (decode: keys in the cache, the new one included)
    seq_order: torch.Tensor | None = None  # [batch] int32 (decode): longest first, for the kernel's grid


_forward_context: AttentionMetadata | None = None


@contextmanager
def set_forward_context(metadata: AttentionMetadata):
    """Make `metadata` visible to the attention layers for the duration of one forward."""
    global _forward_context
    previous, _forward_context = _forward_context, metadata
    try:
        yield metadata
    finally:
        _forward_context = previous


def get_forward_context() -> AttentionMetadata:
    if _forward_context is None:
        raise RuntimeError("attention called outside set_forward_context(...): no step metadata")
    return _forward_context


def prefill_metadata(seq_lens: list[int], device="cpu") -> AttentionMetadata:
    """Metadata of whole prompts packed back to back with no KV cache: a model run on its own
    (parity tests, notebooks). The engine's steps get theirs from ModelRunner.make_batch."""
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return AttentionMetadata(True, torch.full((sum(seq_lens),), -1, dtype=torch.int32, device=device), cu, cu,
                             max(seq_lens), max(seq_lens))


@dataclass(frozen=True)
class AttentionBackend:
    """Store-then-attend through three flash-attn-style functions."""

    name: str
    store_kvcache: Callable
    flash_attn_varlen_func: Callable
    flash_attn_with_kvcache: Callable

    def store(self, layer: "Attention", k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata):
        self.store_kvcache(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping, layer.k_scale, layer.v_scale)

    def attend(self, layer: "Attention", q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: this step's [num_tokens, num_kv_heads, head_dim]."""
        if not meta.is_prefill:
            return self.decode(layer, q, meta)
        return self.prefill(layer, q, k, v, meta)

    def prefill(self, layer: "Attention", q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        cache = {}
        if meta.block_tables is not None:  # some sequence continues a prefix that lives only in the cache
            cache = dict(block_table=meta.block_tables, k_cache=layer.k_cache, v_cache=layer.v_cache,
                         k_descale=layer.k_scale, v_descale=layer.v_scale)
        return self.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k, max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k, softmax_scale=layer.scale, causal=True, **cache)

    def decode(self, layer: "Attention", q, meta: AttentionMetadata) -> torch.Tensor:
        out = self.flash_attn_with_kvcache(
            q.unsqueeze(1), layer.k_cache, layer.v_cache, cache_seqlens=meta.context_lens,
            block_table=meta.block_tables, softmax_scale=layer.scale, causal=True, seq_order=meta.seq_order,
            k_descale=layer.k_scale, v_descale=layer.v_scale)
        return out.squeeze(1)


def get_attention_backend(name: str) -> AttentionBackend:
    import minivllm.kernels as kernels  # (imports triton: only when a backend is asked for)

    if name == "torch":
        return AttentionBackend("torch", kernels.store_kvcache_ref, kernels.flash_attn_varlen_ref,
                                kernels.flash_attn_with_kvcache_ref)
    if name == "triton":
        return AttentionBackend("triton", kernels.store_kvcache, kernels.flash_attn_varlen_func,
                                kernels.flash_attn_with_kvcache)
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'triton'")


class Attention(nn.Module):
    """Causal multi-head attention with grouped KV heads over the paged KV cache.

    The ModelRunner assigns `k_cache`/`v_cache` ([num_blocks, block_size, num_kv_heads, head_dim])
    and the `backend`; until then (parity tests) attention runs on the step's own K/V alone, with
    the naive references. `k_scale`/`v_scale` are the cache's scales when it stores codes under a
    scale ([1] float32, kernels/quant_fp8.py), else None.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads, self.scale = num_heads, head_dim, num_kv_heads, scale
        self.backend = get_attention_backend("torch")
        self.k_cache = self.v_cache = torch.tensor([])
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] (after
        RoPE). Stores k and v in the cache, then attends; returns [num_tokens, num_heads, head_dim]."""
        meta = get_forward_context()
        if self.k_cache.numel():
            self.backend.store(self, k, v, meta)
        return self.attend(q, k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention over the cache, this step's K/V already stored."""
        return self.backend.attend(self, q, k, v, get_forward_context())
