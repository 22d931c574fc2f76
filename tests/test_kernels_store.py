"""store_kvcache (Triton) against store_kvcache_ref: scatter into the paged cache, slot -1 skipped."""
import pytest
import torch

from conftest_kernels import DEVICE, DTYPES, needs_cuda, randn  # noqa: I001 (sets TRITON_INTERPRET first)
from minivllm.kernels import store_kvcache, store_kvcache_ref


def _check_store(num_tokens, num_blocks, block_size, num_kv_heads, head_dim, dtype, slot_dtype):
    # key/value are strided views into a fused qkv buffer, as the attention layer passes them.
    kv_size = num_kv_heads * head_dim
    qkv = randn(num_tokens, 2 * kv_size + 2 * kv_size, dtype=dtype)  # [q (2 heads per kv head), k, v]
    key = qkv[:, 2 * kv_size:3 * kv_size].view(-1, num_kv_heads, head_dim)
    value = qkv[:, 3 * kv_size:].view(-1, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[torch.rand(num_tokens) < 0.2] = -1  # padding tokens
    slot_mapping = slots.to(slot_dtype).to(DEVICE)
    k_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(key, value, k_expected, v_expected, slot_mapping)
    store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    assert (slots >= 0).any() and (slots < 0).any()
    # Exact: written slots hold the new rows, every other slot (the -1 ones too) is untouched.
    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kvcache_matches_reference(block_size, dtype, slot_dtype):
    _check_store(num_tokens=37, num_blocks=max(4, 64 // block_size), block_size=block_size,
                 num_kv_heads=2, head_dim=64, dtype=dtype, slot_dtype=slot_dtype)


@pytest.mark.parametrize("num_kv_heads, head_dim", [(1, 128), (3, 80), (8, 96)])
def test_store_kvcache_head_shapes(num_kv_heads, head_dim):
    _check_store(num_tokens=19, num_blocks=8, block_size=4, num_kv_heads=num_kv_heads,
                 head_dim=head_dim, dtype=torch.float16, slot_dtype=torch.int64)


def test_store_kvcache_no_tokens():
    k_cache = randn(2, 4, 2, 64, dtype=torch.float16)
    before = k_cache.clone()
    empty = randn(0, 2, 64, dtype=torch.float16)
    store_kvcache(empty, empty, k_cache, k_cache.clone(), torch.zeros(0, dtype=torch.int32, device=DEVICE))
    assert torch.equal(k_cache, before)


@needs_cuda
def test_store_kvcache_large_gpu():
    _check_store(num_tokens=8192, num_blocks=1024, block_size=16, num_kv_heads=8, head_dim=128,
                 dtype=torch.bfloat16, slot_dtype=torch.int64)
