"""Writing new keys and values into the paged KV cache ("reshape_and_cache" in vLLM).

Every new token has a slot = block_id * block_size + offset; slot -1 means "skip" (padding rows of
a CUDA graph). vLLM: csrc/cache_kernels.cu (reshape_and_cache_flash).
"""
import torch
import triton
import triton.language as tl


def store_kvcache_ref(key, value, k_cache, v_cache, slot_mapping):
    """Naive reference. key/value: [num_tokens, num_kv_heads, head_dim];
    k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; slot_mapping: [num_tokens]."""
    block_size = k_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = key[token]
        v_cache[slot // block_size, slot % block_size] = value[token]


def store_kvcache(key, value, k_cache, v_cache, slot_mapping):
    """Triton version of `store_kvcache_ref` (same arguments). TODO(kernels helper)."""
    raise NotImplementedError
