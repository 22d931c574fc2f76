"""flash_attn_varlen_func (Triton) against flash_attn_varlen_ref on ragged batches.

Covers mixed lengths in one batch, GQA ratios, head dims with and without padding, causal and not,
prefix-cache hits through shuffled paged block tables, several tile configs, and NaN-poisoned outputs;
and the key tiles the kernel visits and masks with causal_tile_bounds' bounds. They grade exercise
05.1 (_attend_kv_range, the main loop, and causal_tile_bounds); the known wrong answers at the end
must fail them (the grader can fail).
"""
import pytest
import torch
import triton
import triton.language as tl

import conftest_kernels as ck  # noqa: I001 (sets TRITON_INTERPRET before triton is imported)
from conftest_kernels import DEVICE, DTYPES, assert_close, cu_seqlens, needs_cuda, paged_cache, randn
from minivllm.kernels import flash_attn_varlen_func, flash_attn_varlen_ref
from minivllm.kernels import flash_attn_varlen as prefill_module
from minivllm.kernels.flash_attn_varlen import PrefillConfig, flash_attn_varlen_launch
from wrong_answers import builds_on_the_engine, case_id, rejected


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(prefill_module, "torch", ck.PoisonedTorch())


def _contiguous_case(lengths, num_heads, num_kv_heads, head_dim, dtype):
    total = sum(lengths)
    q = randn(total, num_heads, head_dim, dtype=dtype)
    k = randn(total, num_kv_heads, head_dim, dtype=dtype)
    v = randn(total, num_kv_heads, head_dim, dtype=dtype)
    return q, k, v, cu_seqlens(lengths)


def _run_both(q, k, v, cu_q, cu_k, max_q, max_k, config=None, **kwargs):
    expected = flash_attn_varlen_ref(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    if config is None:
        actual = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    else:
        actual = flash_attn_varlen_launch(q, k, v, cu_q, cu_k, max_q, kwargs.get("softmax_scale"),
                                          kwargs.get("causal", False), kwargs.get("block_table"), config)
    assert_close(actual, expected)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", DTYPES[:1])  # the interpreter's float16 dot is slow (no BLAS)
def test_ragged_batch_with_long_sequence(dtype, causal):
    lengths = [1, 7, 16, 17, 233, 1000]
    q, k, v, cu = _contiguous_case(lengths, num_heads=2, num_kv_heads=1, head_dim=64, dtype=dtype)
    _run_both(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal)


def _tile_bounds_probe(m0_ptr, seqlen_q_ptr, seqlen_k_ptr, out_ptr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """Program i stores causal_tile_bounds of case i: out[i] = (end_n, full_end)."""
    i = tl.program_id(0)
    end_n, full_end = prefill_module.causal_tile_bounds(
        tl.load(m0_ptr + i), tl.load(seqlen_q_ptr + i), tl.load(seqlen_k_ptr + i), BLOCK_M=BLOCK_M, CAUSAL=CAUSAL)
    tl.store(out_ptr + 2 * i, end_n)
    tl.store(out_ptr + 2 * i + 1, full_end)


def kernel_tile_bounds(cases, block_m, causal):
    """causal_tile_bounds (the module's, whatever it is now) of each (m0, seqlen_q, seqlen_k), run
    inside a kernel. triton.jit again on each call: a compiled probe would keep the function it was
    compiled with."""
    m0, seqlen_q, seqlen_k = (torch.tensor(c, dtype=torch.int32, device=DEVICE) for c in zip(*cases))
    out = torch.zeros(len(cases), 2, dtype=torch.int32, device=DEVICE)
    triton.jit(_tile_bounds_probe)[(len(cases),)](m0, seqlen_q, seqlen_k, out, BLOCK_M=block_m, CAUSAL=causal)
    return [tuple(row) for row in out.tolist()]


def needed_bounds(m0, seqlen_q, seqlen_k, block_m, causal):
    """The tightest (end_n, full_end) from the mask itself: 1 + the last key any real row of the tile
    sees, and the number of keys every one of them sees (each row sees a prefix of the keys)."""
    rows = range(m0, min(m0 + block_m, seqlen_q))
    seen = [min(seqlen_k, max(0, i + seqlen_k - seqlen_q + 1)) if causal else seqlen_k for i in rows]
    return max(seen), min(seen)


def visited_tiles(end_n, full_end, seqlen_k, paged_len, block_n):
    """(unmasked, masked) key tiles that flash_attn_varlen_kernel's four _attend_kv_range calls visit
    with these bounds: the paged prefix [0, paged_len) first, then the contiguous keys."""
    def num_tiles(start, end):
        return len(range(start, end, block_n))
    paged_full_end = min(full_end, paged_len) // block_n * block_n
    new_full_end = paged_len + max(full_end - paged_len, 0) // block_n * block_n
    return (num_tiles(0, paged_full_end) + num_tiles(paged_len, new_full_end),
            num_tiles(paged_full_end, min(end_n, paged_len)) + num_tiles(new_full_end, end_n))


# (seqlen_q, seqlen_k): prefill, chunks after a prefix (k > q, the prefix paged or not), and k < q
TILE_BOUND_LENGTHS = [(1, 1), (7, 7), (16, 16), (17, 17), (100, 100), (233, 233), (3, 50), (40, 300),
                      (64, 320), (100, 37), (9, 4), (1, 1000)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block_m", [16, 64])
def test_causal_tile_bounds_visit_only_the_tiles_needed(block_m, causal):
    """The kernel visits every key tile some row of a query tile sees, masks each tile that holds a key
    some row does not see, and does no more: counted tile by tile, for each query tile of each length,
    BLOCK_N 16, 32 and 64, keys all contiguous or the prefix paged."""
    cases = [(m0, q, k) for q, k in TILE_BOUND_LENGTHS for m0 in range(0, q, block_m)]
    for (m0, seqlen_q, seqlen_k), (end_n, full_end) in zip(cases, kernel_tile_bounds(cases, block_m, causal)):
        where = f"m0={m0}, seqlen_q={seqlen_q}, seqlen_k={seqlen_k}, BLOCK_M={block_m}, causal={causal}"
        assert 0 <= full_end <= end_n <= seqlen_k, f"(end_n, full_end) = {(end_n, full_end)} at {where}"
        need_end, need_full = needed_bounds(m0, seqlen_q, seqlen_k, block_m, causal)
        for paged_len in sorted({0, max(seqlen_k - seqlen_q, 0)}):
            for block_n in (16, 32, 64):
                got = visited_tiles(end_n, full_end, seqlen_k, paged_len, block_n)
                needed = visited_tiles(need_end, need_full, seqlen_k, paged_len, block_n)
                assert got == needed, (f"(unmasked, masked) tiles visited {got}, needed {needed}, with "
                                       f"(end_n, full_end) = {(end_n, full_end)} at {where}, "
                                       f"BLOCK_N={block_n}, paged prefix {paged_len}")


GQA_HEAD_DIMS = [(g, 64) for g in (1, 2, 3, 4, 8, 16)] + [(2, 128), (2, 80), (2, 96), (16, 80)]


@pytest.mark.parametrize("group_size, head_dim", GQA_HEAD_DIMS)
def test_gqa_ratios_and_head_dims(group_size, head_dim):
    lengths = [1, 7, 16, 17, 40]
    num_kv_heads = 2 if group_size <= 2 else 1
    q, k, v, cu = _contiguous_case(lengths, group_size * num_kv_heads, num_kv_heads, head_dim,
                                   DTYPES[0])
    _run_both(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)


@pytest.mark.parametrize("softmax_scale", [None, 0.3])
def test_softmax_scale(softmax_scale):
    lengths = [5, 40]
    q, k, v, cu = _contiguous_case(lengths, 4, 2, 64, torch.float32)
    _run_both(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, softmax_scale=softmax_scale)


@pytest.mark.parametrize("config", [PrefillConfig(16, 16, 4, 1), PrefillConfig(16, 64, 4, 1),
                                    PrefillConfig(64, 16, 4, 1), PrefillConfig(32, 32, 4, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_tile_configs(config, causal):
    lengths = [1, 17, 16, 95]
    q, k, v, cu = _contiguous_case(lengths, 3, 1, 64, torch.float32)
    _run_both(q, k, v, cu, cu, max(lengths), max(lengths), config=config, causal=causal)


def test_more_keys_than_queries_and_fully_masked_rows():
    """Bottom-right causal alignment both ways: with more keys than queries the queries see the
    whole prefix; with fewer keys the first query rows see nothing and must be zeros."""
    lengths_q, lengths_k = [3, 40, 9], [50, 40, 4]
    q = randn(sum(lengths_q), 4, 64, dtype=torch.float32)
    k = randn(sum(lengths_k), 2, 64, dtype=torch.float32)
    v = randn(sum(lengths_k), 2, 64, dtype=torch.float32)
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    _run_both(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True)
    _run_both(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=False)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True)
    assert torch.equal(out[-9:-4], torch.zeros_like(out[-9:-4]))  # rows 0-4 of the last sequence


def _chunk_case(new_lens, prefix_lens, block_size, num_heads, num_kv_heads, head_dim, dtype):
    """Chunks that continue a cached prefix, as the engine runs them: the prefix in a paged cache
    (shuffled blocks), the chunk's own keys contiguous and packed like q."""
    context_lens = [p + n for p, n in zip(prefix_lens, new_lens)]
    k_cache, v_cache, block_table = paged_cache(context_lens, block_size, num_kv_heads, head_dim, dtype)
    q = randn(sum(new_lens), num_heads, head_dim, dtype=dtype)
    k = randn(sum(new_lens), num_kv_heads, head_dim, dtype=dtype)
    v = randn(sum(new_lens), num_kv_heads, head_dim, dtype=dtype)
    return q, k, v, k_cache, v_cache, block_table, cu_seqlens(new_lens), cu_seqlens(context_lens)


# Ragged chunks: prefixes that end mid-block, on a block boundary, empty, longer than a tile.
CHUNK_NEW_LENS, CHUNK_PREFIX_LENS = [1, 7, 16, 33, 64, 5], [40, 0, 16, 100, 19, 256]


@pytest.mark.parametrize("block_size", [4, 16, 256])
@pytest.mark.parametrize("group_size", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunk_over_paged_prefix(block_size, group_size, dtype):
    q, k, v, k_cache, v_cache, block_table, cu_q, cu_k = _chunk_case(
        CHUNK_NEW_LENS, CHUNK_PREFIX_LENS, block_size, 2 * group_size, 2, 64, dtype)
    _run_both(q, k, v, cu_q, cu_k, max(CHUNK_NEW_LENS), int(cu_k.diff().max()), causal=True,
              block_table=block_table, k_cache=k_cache, v_cache=v_cache)


def test_chunk_over_paged_prefix_not_causal():
    """Without the causal mask every query sees the whole chunk too (phase 2 has no diagonal)."""
    q, k, v, k_cache, v_cache, block_table, cu_q, cu_k = _chunk_case(
        CHUNK_NEW_LENS, CHUNK_PREFIX_LENS, 16, 4, 2, 64, torch.float32)
    _run_both(q, k, v, cu_q, cu_k, max(CHUNK_NEW_LENS), int(cu_k.diff().max()), causal=False,
              block_table=block_table, k_cache=k_cache, v_cache=v_cache)


@pytest.mark.parametrize("block_size", [1, 4, 16, 64, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefix_hit_paged(block_size, dtype):
    """A prefix-cache hit: the cached blocks (some sequences have none) through the block table."""
    new_lens, cached_lens = [1, 7, 16, 17, 60], [0, 33, 16, 100, 5]
    q, k, v, k_cache, v_cache, block_table, cu_q, cu_k = _chunk_case(
        new_lens, cached_lens, block_size, 4, 2, 64, dtype)
    _run_both(q, k, v, cu_q, cu_k, max(new_lens), int(cu_k.diff().max()), causal=True,
              block_table=block_table, k_cache=k_cache, v_cache=v_cache)


@pytest.mark.parametrize("group_size, head_dim", [(3, 80), (8, 128)])
def test_prefix_hit_paged_gqa_head_dims(group_size, head_dim):
    new_lens, cached_lens = [20, 3], [45, 0]
    q, k, v, k_cache, v_cache, block_table, cu_q, cu_k = _chunk_case(
        new_lens, cached_lens, 16, group_size, 1, head_dim, torch.float16)
    _run_both(q, k, v, cu_q, cu_k, max(new_lens), int(cu_k.diff().max()), causal=True,
              block_table=block_table, k_cache=k_cache, v_cache=v_cache, softmax_scale=0.1)


@pytest.mark.parametrize("config", [PrefillConfig(16, 16, 4, 1), PrefillConfig(32, 64, 4, 1),
                                    PrefillConfig(16, 128, 4, 1)])
@pytest.mark.parametrize("block_size", [16, 256])
def test_chunk_tile_configs(config, block_size):
    """Tiles smaller and larger than a KV block (one block id per tile, or several)."""
    q, k, v, k_cache, v_cache, block_table, cu_q, cu_k = _chunk_case(
        CHUNK_NEW_LENS, CHUNK_PREFIX_LENS, block_size, 2, 1, 64, torch.float32)
    expected = flash_attn_varlen_ref(q, k, v, cu_q, cu_k, max(CHUNK_NEW_LENS), 0, causal=True,
                                     block_table=block_table, k_cache=k_cache, v_cache=v_cache)
    actual = flash_attn_varlen_launch(q, k, v, cu_q, cu_k, max(CHUNK_NEW_LENS), None, True, block_table,
                                      config, k_cache, v_cache)
    assert_close(actual, expected)


def test_chunk_matches_contiguous():
    """The two key layouts give one answer: the prefix paged + new keys contiguous, every key
    contiguous."""
    new_lens, prefix_lens, block_size = [9, 30], [23, 48], 16
    q, k, v, k_cache, v_cache, block_table, cu_q, cu_k = _chunk_case(
        new_lens, prefix_lens, block_size, 4, 2, 64, torch.float32)
    # Write the new keys into the cache after their prefix, and gather every key contiguously.
    k_all, v_all, cu_q_list = [], [], cu_q.tolist()
    for i, (p, n) in enumerate(zip(prefix_lens, new_lens)):
        t = torch.arange(p, p + n, device=q.device)
        slots = block_table[i, t // block_size].long() * block_size + t % block_size
        k_cache.view(-1, 2, 64)[slots] = k[cu_q_list[i]:cu_q_list[i + 1]]
        v_cache.view(-1, 2, 64)[slots] = v[cu_q_list[i]:cu_q_list[i + 1]]
        t = torch.arange(p + n, device=q.device)
        slots = block_table[i, t // block_size].long() * block_size + t % block_size
        k_all.append(k_cache.view(-1, 2, 64)[slots])
        v_all.append(v_cache.view(-1, 2, 64)[slots])
    args = (cu_q, cu_k, max(new_lens), int(cu_k.diff().max()))
    split = flash_attn_varlen_func(q, k, v, *args, causal=True, block_table=block_table,
                                   k_cache=k_cache, v_cache=v_cache)
    contiguous = flash_attn_varlen_func(q, torch.cat(k_all), torch.cat(v_all), *args, causal=True)
    assert_close(split, contiguous)


def test_rejects_unsupported_arguments():
    q, k, v, cu = _contiguous_case([4], 2, 1, 64, torch.float32)
    with pytest.raises(NotImplementedError, match="window_size"):
        flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, window_size=(8, 0))
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, dropout_p=0.1)
    k_cache, v_cache, block_table = paged_cache([4], 4, 1, 64, torch.float32)
    for fn in (flash_attn_varlen_func, flash_attn_varlen_ref):  # flash-attn's every-key-paged layout
        with pytest.raises(NotImplementedError, match="k_cache"):
            fn(q, k_cache, v_cache, cu, cu, 4, 4, block_table=block_table)


@needs_cuda
@pytest.mark.parametrize("lengths", [[1, 7, 16, 17, 233, 1000, 4096], [16384], [512] * 16])
def test_realistic_sizes_gpu(lengths):
    q, k, v, cu = _contiguous_case(lengths, 16, 8 if max(lengths) < 16384 else 2, 128, torch.bfloat16)
    if max(lengths) == 16384:  # keep the float32 reference's [heads, 16k, 16k] scores in memory
        q = q[:, :4].contiguous()
    _run_both(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)


@needs_cuda
@pytest.mark.parametrize("head_dim", [64, 128])
def test_float32_long_prompt_gpu(head_dim):
    """float32 takes tiles that fit in shared memory (the bfloat16 ones for long prompts do not)."""
    q, k, v, cu = _contiguous_case([4096, 300], 4, 2, head_dim, torch.float32)
    _run_both(q, k, v, cu, cu, 4096, 4096, causal=True)


@needs_cuda
def test_chunk_over_long_prefix_gpu():
    """Engine-sized chunks: 2k tokens over 8k of cached prefix (the float32 reference on 4 heads)."""
    new_lens, prefix_lens = [2048, 1000, 1], [8192, 3000, 4095]
    for block_size in (16, 256):
        q, k, v, k_cache, v_cache, block_table, cu_q, cu_k = _chunk_case(
            new_lens, prefix_lens, block_size, 4, 2, 128, torch.bfloat16)
        _run_both(q, k, v, cu_q, cu_k, max(new_lens), int(cu_k.diff().max()), causal=True,
                  block_table=block_table, k_cache=k_cache, v_cache=v_cache)


@needs_cuda
def test_prefix_hit_realistic_gpu():
    new_lens, cached_lens = [1000, 1, 2048, 300], [3000, 4095, 2048, 0]
    for block_size in (16, 256):
        q, k, v, k_cache, v_cache, block_table, cu_q, cu_k = _chunk_case(
            new_lens, cached_lens, block_size, 16, 8, 128, torch.bfloat16)
        _run_both(q, k, v, cu_q, cu_k, max(new_lens), int(cu_k.diff().max()), causal=True,
                  block_table=block_table, k_cache=k_cache, v_cache=v_cache)


# ------------------------------------------------------------------------------------------------
# Known wrong answers: each must fail a check that grades exercise 05.1. A wrong device
# function goes in by the module's name, into fresh copies of its kernels (conftest_kernels.fresh_kernels).
# ------------------------------------------------------------------------------------------------

@triton.jit
def bounds_that_mask_everything(m0, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """Visits every key and masks every tile: right outputs, no tile skipped, no tile unmasked."""
    return seqlen_k, 0


@triton.jit
def bounds_aligned_top_left(m0, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """Row i sees keys j <= i: a chunk after a cached prefix loses the prefix's last keys."""
    end_n = seqlen_k
    full_end = seqlen_k
    if CAUSAL:
        end_n = tl.minimum(seqlen_k, m0 + BLOCK_M)
        full_end = tl.minimum(seqlen_k, m0 + 1)
    return end_n, full_end


@triton.jit
def bounds_without_masked_tiles(m0, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """The diagonal tiles run unmasked: rows see keys past their diagonal."""
    end_n = seqlen_k
    if CAUSAL:
        end_n = tl.maximum(tl.minimum(seqlen_k, m0 + BLOCK_M + seqlen_k - seqlen_q), 0)
    return end_n, end_n


@triton.jit
def softmax_step_without_the_rescale(qk, m_i, l_i, MASKED: tl.constexpr):
    """Sums each tile against its own new max but never rescales what came before (alpha = 1)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk - m_use[:, None])
    return p, tl.full(m_i.shape, 1.0, tl.float32), l_i + tl.sum(p, 1), m_new


@triton.jit
def softmax_step_without_the_empty_row_guard(qk, m_i, l_i, MASKED: tl.constexpr):
    """exp2(-inf - -inf) = NaN for a row that has seen no visible key yet."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


engine_attend_kv_range = prefill_module._attend_kv_range


@triton.jit
def loop_that_reads_nothing(
    acc, l_i, m_i, q, k_ptr, v_ptr, block_table_row_ptr,
    start_n, end_n, row_base, key_limit, diag, offs_m, offs_d, d_ok, qk_scale,
    stride_kb, stride_kt, stride_vb, stride_vt, k_descale, v_descale,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, D_MASK: tl.constexpr, KV_FP8: tl.constexpr,
):
    """The trivial answer: the state passes through unchanged (every row sees no key)."""
    return acc, l_i, m_i


@triton.jit
def loop_without_the_causal_mask(
    acc, l_i, m_i, q, k_ptr, v_ptr, block_table_row_ptr,
    start_n, end_n, row_base, key_limit, diag, offs_m, offs_d, d_ok, qk_scale,
    stride_kb, stride_kt, stride_vb, stride_vt, k_descale, v_descale,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, D_MASK: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Masks the keys past the sequence's end only: the diagonal tiles let rows see later keys."""
    return engine_attend_kv_range(
        acc, l_i, m_i, q, k_ptr, v_ptr, block_table_row_ptr, start_n, end_n, row_base, key_limit, diag, offs_m,
        offs_d, d_ok, qk_scale, stride_kb, stride_kt, stride_vb, stride_vt, k_descale, v_descale,
        BLOCK_N=BLOCK_N, BLOCK_SIZE=BLOCK_SIZE, PAGED=PAGED, MASKED=MASKED, CAUSAL=False, D_MASK=D_MASK,
        KV_FP8=KV_FP8)


@triton.jit
def loop_that_ignores_the_block_table(
    acc, l_i, m_i, q, k_ptr, v_ptr, block_table_row_ptr,
    start_n, end_n, row_base, key_limit, diag, offs_m, offs_d, d_ok, qk_scale,
    stride_kb, stride_kt, stride_vb, stride_vt, k_descale, v_descale,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, D_MASK: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Reads the cached prefix as if its blocks were in order: cache row j for prefix key j."""
    return engine_attend_kv_range(
        acc, l_i, m_i, q, k_ptr, v_ptr, block_table_row_ptr, start_n, end_n, row_base, key_limit, diag, offs_m,
        offs_d, d_ok, qk_scale, stride_kb, stride_kt, stride_vb, stride_vt, k_descale, v_descale,
        BLOCK_N=BLOCK_N, BLOCK_SIZE=BLOCK_SIZE, PAGED=False, MASKED=MASKED, CAUSAL=CAUSAL, D_MASK=D_MASK,
        KV_FP8=KV_FP8)


def check_tile_bounds():
    for block_m in (16, 64):
        test_causal_tile_bounds_visit_only_the_tiles_needed(block_m, causal=True)


def check_causal_ragged_batch():
    test_ragged_batch_with_long_sequence(torch.float32, causal=True)


def check_chunk_over_paged_prefix():
    test_chunk_over_paged_prefix(16, 2, torch.float32)


@builds_on_the_engine
@pytest.mark.parametrize("name, wrong, check", [
    ("causal_tile_bounds", bounds_that_mask_everything, check_tile_bounds),
    ("causal_tile_bounds", bounds_aligned_top_left, check_tile_bounds),
    ("causal_tile_bounds", bounds_aligned_top_left, check_chunk_over_paged_prefix),
    ("causal_tile_bounds", bounds_without_masked_tiles, check_tile_bounds),
    ("causal_tile_bounds", bounds_without_masked_tiles, check_causal_ragged_batch),
    ("online_softmax_update", softmax_step_without_the_rescale, check_causal_ragged_batch),
    ("online_softmax_update", softmax_step_without_the_empty_row_guard,
     test_more_keys_than_queries_and_fully_masked_rows),
    ("_attend_kv_range", loop_that_reads_nothing, check_causal_ragged_batch),
    ("_attend_kv_range", loop_without_the_causal_mask, check_causal_ragged_batch),
    ("_attend_kv_range", loop_that_ignores_the_block_table, check_chunk_over_paged_prefix),
], ids=case_id)
def test_the_prefill_checks_reject_a_wrong_loop_or_bound(name, wrong, check, monkeypatch):
    # 05.1 is the whole loop and its bounds: a loop that calls a wrong softmax step is a wrong loop.
    ck.fresh_kernels(monkeypatch, prefill_module)
    rejected(check, prefill_module, name, wrong)
