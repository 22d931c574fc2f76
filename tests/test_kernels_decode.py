"""flash_attn_with_kvcache (Triton paged decode + split merge) against flash_attn_with_kvcache_ref.

Covers ragged contexts (0, 1, 7, 16, 17, 233, 1000) in one batch, shuffled block tables, block sizes
1..256, GQA ratios 1-16, head dims 64/128/80/96, forced and automatic context splits, several query
tokens per sequence, and NaN-poisoned outputs and split buffers.
"""
import pytest
import torch

import conftest_kernels as ck  # noqa: I001 (sets TRITON_INTERPRET before triton is imported)
from conftest_kernels import DEVICE, DTYPES, assert_close, needs_cuda, paged_cache, randn
from minivllm.kernels import flash_attn_with_kvcache, flash_attn_with_kvcache_ref, store_kvcache
from minivllm.kernels import paged_decode as decode_module

CONTEXTS = [0, 1, 7, 16, 17, 233, 1000]


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(decode_module, "torch", ck.PoisonedTorch())


def _check_decode(context_lens, block_size, num_heads, num_kv_heads, head_dim, dtype,
                  seqlen_q=1, **kwargs):
    k_cache, v_cache, block_table = paged_cache(context_lens, block_size, num_kv_heads, head_dim, dtype)
    q = randn(len(context_lens), seqlen_q, num_heads, head_dim, dtype=dtype)
    cache_seqlens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    args = dict(cache_seqlens=cache_seqlens, block_table=block_table, **kwargs)
    actual = flash_attn_with_kvcache(q, k_cache, v_cache, **args)
    expected = flash_attn_with_kvcache_ref(q, k_cache, v_cache, **args)
    assert_close(actual, expected)
    return actual


@pytest.mark.parametrize("block_size, num_splits", [(1, 0), (1, 3), (16, 1), (16, 0), (256, 7)])
def test_ragged_contexts(block_size, num_splits):
    out = _check_decode(CONTEXTS, block_size, 4, 2, 64, DTYPES[0], num_splits=num_splits)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # context length 0 (CUDA-graph padding)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_seq_order_changes_no_result(num_splits):
    """seq_order only reorders the programs: longest first, reversed, and identity agree exactly."""
    k_cache, v_cache, block_table = paged_cache(CONTEXTS, 16, 2, 64, DTYPES[0])
    q = randn(len(CONTEXTS), 1, 4, 64, dtype=DTYPES[0])
    seqlens = torch.tensor(CONTEXTS, dtype=torch.int32, device=DEVICE)
    args = dict(cache_seqlens=seqlens, block_table=block_table, num_splits=num_splits)
    plain = flash_attn_with_kvcache(q, k_cache, v_cache, **args)
    assert_close(plain, flash_attn_with_kvcache_ref(q, k_cache, v_cache, **args))
    for order in (torch.argsort(seqlens, descending=True), torch.arange(len(CONTEXTS) - 1, -1, -1, device=DEVICE)):
        ordered = flash_attn_with_kvcache(q, k_cache, v_cache, seq_order=order.to(torch.int32), **args)
        assert torch.equal(ordered, plain)
    with pytest.raises(AssertionError, match="seq_order"):
        flash_attn_with_kvcache(q, k_cache, v_cache, seq_order=seqlens[:2], **args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [4, 64])
def test_dtypes(block_size, dtype):
    _check_decode([0, 5, 16, 90], block_size, 4, 2, 64, dtype, num_splits=2)


GQA_HEAD_DIMS = [(g, 64) for g in (1, 2, 3, 4, 8, 16)] + [(2, 128), (2, 80), (2, 96), (16, 80), (8, 128)]


@pytest.mark.parametrize("group_size, head_dim", GQA_HEAD_DIMS)
def test_gqa_ratios_and_head_dims(group_size, head_dim):
    _check_decode([1, 17, 70], 16, group_size, 1, head_dim, DTYPES[0])


@pytest.mark.parametrize("softmax_scale", [None, 0.05])
def test_softmax_scale(softmax_scale):
    _check_decode([9, 40], 8, 8, 2, 128, DTYPES[0], softmax_scale=softmax_scale, num_splits=2)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seqlen_q", [2, 4])
def test_several_query_tokens(seqlen_q, causal):
    """seqlen_q > 1 (e.g. speculative tokens): causal alignment is bottom-right."""
    _check_decode([4, 33, 100], 16, 4, 2, 64, DTYPES[0], seqlen_q=seqlen_q, causal=causal, num_splits=3)


def test_rejects_unsupported_arguments():
    k_cache, v_cache, block_table = paged_cache([3], 16, 1, 64, torch.float32)
    q = randn(1, 1, 2, 64, dtype=torch.float32)
    seqlens = torch.tensor([3], dtype=torch.int32, device=DEVICE)
    with pytest.raises(NotImplementedError, match="softcap"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=block_table,
                                softcap=30.0)
    with pytest.raises(ValueError, match="block_table"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)


@needs_cuda
@pytest.mark.parametrize("batch, max_context, block_size", [(256, 4096, 16), (8, 32768, 16), (1, 32768, 256),
                                                            (64, 4096, 256)])
def test_realistic_sizes_gpu(batch, max_context, block_size):
    context_lens = torch.randint(1, max_context + 1, (batch,)).tolist()
    context_lens[0] = max_context
    if batch > 1:
        context_lens[1] = 0
    _check_decode(context_lens, block_size, 16, 8, 128, torch.bfloat16)


@needs_cuda
def test_cuda_graph_capture_and_replay():
    """store_kvcache + decode captured once, replayed with new contents in the same buffers."""
    batch, num_heads, num_kv_heads, head_dim, block_size = 32, 16, 8, 128, 16
    context_lens = torch.randint(1, 2000, (batch,)).tolist()
    k_cache, v_cache, block_table = paged_cache(context_lens, block_size, num_kv_heads, head_dim,
                                                torch.bfloat16)
    q = randn(batch, 1, num_heads, head_dim, dtype=torch.bfloat16)
    key = randn(batch, num_kv_heads, head_dim, dtype=torch.bfloat16)
    value = randn(batch, num_kv_heads, head_dim, dtype=torch.bfloat16)
    seqlens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    slot_mapping = torch.full((batch,), -1, dtype=torch.int64, device=DEVICE)

    def step():
        store_kvcache(key, value, k_cache, v_cache, slot_mapping)
        return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=block_table)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(2):  # new contents: query, one new token per sequence, shorter contexts
        new_lens = (torch.rand(batch) * (torch.tensor(context_lens) + 1)).long().clamp(min=1)
        new_lens[0] = 0  # a padding row: no token stored (slot -1), zeros out
        seqlens.copy_(new_lens)
        q.copy_(torch.randn_like(q))
        key.copy_(torch.randn_like(key))
        value.copy_(torch.randn_like(value))
        last = (new_lens - 1).clamp(min=0).to(DEVICE)
        slots = block_table.gather(1, (last // block_size)[:, None]).squeeze(1).long() * block_size
        slots = torch.where(new_lens.to(DEVICE) > 0, slots + last % block_size, -1)
        slot_mapping.copy_(slots)
        graph.replay()
        torch.cuda.synchronize()
        expected = flash_attn_with_kvcache_ref(q, k_cache, v_cache, cache_seqlens=seqlens,
                                               block_table=block_table)
        assert_close(out, expected)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        stored = slots >= 0
        assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[slots[stored]], key[stored])
        assert torch.equal(v_cache.view(-1, num_kv_heads, head_dim)[slots[stored]], value[stored])
