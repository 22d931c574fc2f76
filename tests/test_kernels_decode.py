"""flash_attn_with_kvcache (Triton paged decode + split merge) against flash_attn_with_kvcache_ref.

Covers ragged contexts (0, 1, 7, 16, 17, 233, 1000) in one batch, shuffled block tables, block sizes
1..256, GQA ratios 1-16, head dims 64/128/80/96, forced and automatic context splits, several query
tokens per sequence, dots padded to 64 rows, and NaN-poisoned outputs and split buffers; and what
each context split reads, from the split buffers. They grade exercise 06.1 (_attend_split: a
split's range and its loop over the block table; merge_splits_kernel: the merge of the splits); the
known wrong answers at the end must fail them.
"""
import dataclasses
import math

import pytest
import torch
import triton
import triton.language as tl

import conftest_kernels as ck  # noqa: I001 (sets TRITON_INTERPRET before triton is imported)
from conftest_kernels import DEVICE, DTYPES, assert_close, needs_cuda, paged_cache, randn
from minivllm.kernels import flash_attn_with_kvcache, flash_attn_with_kvcache_ref, store_kvcache
from minivllm.kernels import _common as common_module
from minivllm.kernels import paged_decode as decode_module
from minivllm.kernels.paged_decode import DecodeConfig, paged_decode_launch
from wrong_answers import builds_on_the_engine, case_id, rejected

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


def test_large_scores_merge_without_overflow():
    """Scores of hundreds (in log2 units) per split: 2^lse overflows float32, the merge must not."""
    _check_decode([0, 40, 233, 1000], 16, 4, 2, 64, DTYPES[0], softmax_scale=8.0, num_splits=4)


class RecordingTorch(ck.PoisonedTorch):
    """PoisonedTorch that also keeps every tensor torch.empty made: the launch's split buffers."""

    def __init__(self):
        self.made = []

    def empty(self, *args, **kwargs):
        tensor = super().empty(*args, **kwargs)
        self.made.append(tensor)
        return tensor


SPLIT_CONTEXTS = [0, 1, 7, 16, 17, 31, 32, 33, 100, 233, 1000]
# BLOCK_N 16 with min_split_tokens 32: a split of a short context may not be as small as one tile.
SPLIT_CONFIG = DecodeConfig(block_n=16, num_warps=4, num_stages=1, programs_per_sm=2, min_split_tokens=32)


def split_reads(context_lens, num_splits, monkeypatch):
    """For each sequence, the (first token, token count) each split read: with q = 0 every score is
    0, so split s's log-sum-exp is log2(its token count) and its output the mean of its values, and
    the value of context token t is t."""
    block_size = 16
    k_cache, v_cache, block_table = paged_cache(context_lens, block_size, 1, 16, torch.float32)
    for i, n in enumerate(context_lens):
        t = torch.arange(n, device=DEVICE)
        v_cache[block_table[i, t // block_size].long(), t % block_size, 0, :] = t[:, None].float()
    q = torch.zeros(len(context_lens), 1, 1, 16, device=DEVICE)
    recording = RecordingTorch()
    monkeypatch.setattr(decode_module, "torch", recording)
    seqlens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    paged_decode_launch(q, k_cache, v_cache, seqlens, block_table, None, True, num_splits, SPLIT_CONFIG)
    mid_out, mid_lse = recording.made[1], recording.made[2]  # [batch, 1, 1, splits, 16], [batch, 1, 1, splits]
    counts = torch.where(mid_lse[:, 0, 0].isneginf(), 0.0, mid_lse[:, 0, 0].exp2()).round().long().tolist()
    means = mid_out[:, 0, 0, :, 0].tolist()
    return [[(round(mean - (count - 1) / 2), count) for mean, count in zip(row_means, row_counts)]
            for row_means, row_counts in zip(means, counts)]


@pytest.mark.parametrize("num_splits", [2, 3, 7, 16])
def test_splits_read_the_context_once_and_evenly(num_splits, monkeypatch):
    """Each sequence's splits read its context exactly once, as consecutive ranges, no split more
    than an equal share rounded up to whole tiles, no more splits than min_split_tokens allows."""
    for seqlen_k, reads in zip(SPLIT_CONTEXTS, split_reads(SPLIT_CONTEXTS, num_splits, monkeypatch)):
        used = [(start, count) for start, count in reads if count > 0]
        covered = 0
        for start, count in sorted(used):
            assert start == covered, f"context {seqlen_k}: splits read (first token, count) {reads}"
            covered += count
        assert covered == seqlen_k, f"context {seqlen_k}: splits read (first token, count) {reads}"
        max_used = max(1, math.ceil(seqlen_k / SPLIT_CONFIG.min_split_tokens))
        assert len(used) <= max_used, (f"context {seqlen_k}: {len(used)} splits read it, min_split_tokens "
                                       f"{SPLIT_CONFIG.min_split_tokens} allows {max_used}: {reads}")
        num_used = min(len(reads), max_used)
        share = math.ceil(math.ceil(seqlen_k / num_used) / SPLIT_CONFIG.block_n) * SPLIT_CONFIG.block_n
        assert max((count for _, count in reads), default=0) <= share, (
            f"context {seqlen_k}, {len(reads)} splits: one reads more than {share} tokens: {reads}")


@pytest.mark.parametrize("group_size, seqlen_q, context_lens", [(2, 1, SPLIT_CONTEXTS), (4, 3, [7, 17, 100, 1000])])
def test_fused_merge_is_the_merge_kernel(group_size, seqlen_q, context_lens, monkeypatch):
    """fused_merge: the last split of each (sequence, KV head) to finish merges the pair's splits itself.
    The same bits as merge_splits_kernel after the decode kernel (the same merge_split_outputs), every
    row written (the outputs start NaN), the counters back at zero, and a second call the same."""
    monkeypatch.setattr(common_module, "_counters", {})
    k_cache, v_cache, block_table = paged_cache(context_lens, 16, 2, 64, torch.float32)
    q = randn(len(context_lens), seqlen_q, 2 * group_size, 64, dtype=torch.float32)
    seqlens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    fused = dataclasses.replace(SPLIT_CONFIG, fused_merge=True)
    for num_splits in (2, 3, 7):
        two_kernels = paged_decode_launch(q, k_cache, v_cache, seqlens, block_table, None, True, num_splits,
                                          SPLIT_CONFIG)
        one_kernel = paged_decode_launch(q, k_cache, v_cache, seqlens, block_table, None, True, num_splits, fused)
        assert torch.equal(one_kernel, two_kernels), f"{num_splits} splits: the fused merge differs"
        counters = common_module.zeroed_counters(q.device, "paged decode's merge")
        assert not counters.any(), f"{num_splits} splits: counters left set: {counters.nonzero().flatten().tolist()}"
        again = paged_decode_launch(q, k_cache, v_cache, seqlens, block_table, None, True, num_splits, fused)
        assert torch.equal(again, one_kernel), f"{num_splits} splits: a second call differs"
    expected = flash_attn_with_kvcache_ref(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=block_table)
    assert_close(one_kernel, expected)


@pytest.mark.parametrize("group_size, seqlen_q", [(1, 1), (8, 1), (4, 3)])
def test_dot_rows_padded_to_min_block_m(group_size, seqlen_q):
    """min_block_m=64: the (query token, head) rows padded to 64 (Hopper's wgmma); the padding rows
    read nothing and write nothing."""
    context_lens = [0, 1, 7, 17, 233]
    k_cache, v_cache, block_table = paged_cache(context_lens, 16, 1, 64, torch.float32)
    q = randn(len(context_lens), seqlen_q, group_size, 64, dtype=torch.float32)
    seqlens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    config = DecodeConfig(block_n=16, num_warps=4, num_stages=1, programs_per_sm=2, min_split_tokens=16,
                          min_block_m=64)
    actual = paged_decode_launch(q, k_cache, v_cache, seqlens, block_table, None, True, 2, config)
    expected = flash_attn_with_kvcache_ref(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=block_table)
    assert_close(actual, expected)


def test_every_variant_compiles_for_hopper_without_a_gpu(tmp_path):
    """The interpreter the CPU tests use does not run Triton's compiler: each split-decode variant the tuner
    launches (a bf16 cache, an FP8 one by the conversion instruction and by integer bits, 16- and 64-row
    dots, tiles loaded by the compiler's 2-stage pipeline or by none) compiles for sm_90
    (tests/compile_for_hopper.py). Its --stats hold what kernels/TUNING.md (run 9) reads in them: the
    2-stage loop copies tiles asynchronously into shared memory and the 1-stage one does not, and an FP8
    tile comes out of shared memory by more plain loads than a bf16 one, which ldmatrix reads."""
    import json

    proc, lines = ck.compile_for_hopper("decode", "--stats", "--json", str(tmp_path / "stats.json"))
    assert proc.returncode == 0 and sum(line.startswith("ok     decode") for line in lines) == 12, (
        proc.stdout[-3000:] + proc.stderr[-3000:])
    stats = {v["variant"]: v for v in json.loads((tmp_path / "stats.json").read_text())["variants"]}
    assert len(stats) == 12 and all(v["registers"] > 0 and v["instructions"] > 0 for v in stats.values())
    for name, v in stats.items():
        assert (v["counts"]["LDGSTS"] > 0) == name.endswith("stages 2"), name
    bf16, fp8 = (stats[f"decode {cache} cache rows 16 stages 2"]["counts"] for cache in ("bf16", "fp8 cvt"))
    assert fp8["LDS"] > bf16["LDS"] and bf16["LDSM"] > fp8["LDSM"], (bf16, fp8)


def test_config_is_validated():
    with pytest.raises(ValueError, match="fp8_convert"):
        DecodeConfig(64, 4, 2, 8, 256, fp8_convert="fast")
    with pytest.raises(ValueError, match="min_block_m"):
        DecodeConfig(64, 4, 2, 8, 256, min_block_m=8)


def test_rejects_unsupported_arguments():
    k_cache, v_cache, block_table = paged_cache([3], 16, 1, 64, torch.float32)
    q = randn(1, 1, 2, 64, dtype=torch.float32)
    seqlens = torch.tensor([3], dtype=torch.int32, device=DEVICE)
    with pytest.raises(NotImplementedError, match="softcap"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=block_table,
                                softcap=30.0)
    with pytest.raises(ValueError, match="block_table"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)


# ------------------------------------------------------------------------------------------------
# Known wrong answers: each must fail a check that grades exercise 06.1. A wrong device
# function goes in by the module's name, into fresh copies of its kernels (conftest_kernels.fresh_kernels).
# ------------------------------------------------------------------------------------------------

@triton.jit
def split_0_reads_everything(split, num_splits, seqlen_k, min_split_tokens, BLOCK_N: tl.constexpr):
    """Right outputs, no parallelism: the other splits read nothing."""
    return tl.where(split == 0, 0, seqlen_k), seqlen_k


@triton.jit
def splits_that_overlap_by_a_tile(split, num_splits, seqlen_k, min_split_tokens, BLOCK_N: tl.constexpr):
    num_splits_used = tl.maximum(tl.minimum(num_splits, tl.cdiv(seqlen_k, min_split_tokens)), 1)
    tokens_per_split = tl.cdiv(tl.cdiv(seqlen_k, num_splits_used), BLOCK_N) * BLOCK_N
    split_start = split * tokens_per_split
    return split_start, tl.minimum(split_start + tokens_per_split + BLOCK_N, seqlen_k)


@triton.jit
def splits_ignoring_min_split_tokens(split, num_splits, seqlen_k, min_split_tokens, BLOCK_N: tl.constexpr):
    """Every program gets a part, however short the context."""
    tokens_per_split = tl.cdiv(tl.cdiv(seqlen_k, num_splits), BLOCK_N) * BLOCK_N
    split_start = split * tokens_per_split
    return split_start, tl.minimum(split_start + tokens_per_split, seqlen_k)


@triton.jit
def splits_of_fewer_programs(split, num_splits, seqlen_k, min_split_tokens, BLOCK_N: tl.constexpr):
    """Uses half the splits it may: each reads twice as much, the step takes twice as long."""
    num_splits_used = tl.maximum(tl.minimum(num_splits, tl.cdiv(seqlen_k, min_split_tokens)) // 2, 1)
    tokens_per_split = tl.cdiv(tl.cdiv(seqlen_k, num_splits_used), BLOCK_N) * BLOCK_N
    split_start = split * tokens_per_split
    return split_start, tl.minimum(split_start + tokens_per_split, seqlen_k)


@triton.jit
def softmax_step_without_the_rescale(qk, m_i, l_i, MASKED: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk - m_use[:, None])
    return p, tl.full(m_i.shape, 1.0, tl.float32), l_i + tl.sum(p, 1), m_new


engine_attend_split = decode_module._attend_split


@triton.jit
def split_that_reads_nothing(
    q, k_head_ptr, v_head_ptr, block_table_row_ptr, split, num_splits, seqlen_k, min_split_tokens,
    last_visible, offs_d, d_ok, qk_scale, block_size, stride_kb, stride_ks, stride_vb, stride_vs,
    BLOCK_M: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
):
    """The trivial answer: every program's share is empty (every row's output is 0)."""
    return (tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32), tl.zeros([BLOCK_M], tl.float32),
            tl.full([BLOCK_M], float("-inf"), tl.float32))


@triton.jit
def split_without_the_causal_mask(
    q, k_head_ptr, v_head_ptr, block_table_row_ptr, split, num_splits, seqlen_k, min_split_tokens,
    last_visible, offs_d, d_ok, qk_scale, block_size, stride_kb, stride_ks, stride_vb, stride_vs,
    BLOCK_M: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Several query tokens see each other's later keys."""
    return engine_attend_split(
        q, k_head_ptr, v_head_ptr, block_table_row_ptr, split, num_splits, seqlen_k, min_split_tokens,
        last_visible, offs_d, d_ok, qk_scale, block_size, stride_kb, stride_ks, stride_vb, stride_vs,
        BLOCK_M=BLOCK_M, HEAD_DIM_PAD=HEAD_DIM_PAD, BLOCK_N=BLOCK_N, CAUSAL=False)


@triton.jit
def merge_by_the_plain_mean(parts, lse):
    """Every split that saw keys weighs the same, whatever its share of the softmax."""
    weights = tl.where(lse == float("-inf"), 0.0, 1.0)
    return tl.sum(parts * weights[:, None], 0) / tl.maximum(tl.sum(weights, 0), 1.0)


@triton.jit
def merge_without_the_max(parts, lse):
    """2^lse overflows for large scores."""
    weights = tl.math.exp2(lse)
    total = tl.sum(weights, 0)
    return tl.sum(parts * weights[:, None], 0) / tl.where(total == 0.0, 1.0, total)


@triton.jit
def merge_that_is_nan_when_every_split_is_empty(parts, lse):
    weights = tl.math.exp2(lse - tl.max(lse, 0))
    return tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)


@triton.jit
def merge_kernel_with_zero_padding(
    mid_out_ptr, mid_lse_ptr, out_ptr, num_splits,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """Loads the padding splits' log-sum-exp as 0, not -inf: they weigh in as splits of one key."""
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(mid_lse_ptr + row * num_splits + offs_s, mask=s_ok, other=0.0)
    parts = tl.load(mid_out_ptr + row * num_splits * HEAD_DIM + offs_s[:, None] * HEAD_DIM
                    + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = decode_module.merge_split_outputs(parts, lse)
    tl.store(out_ptr + row * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def check_splits(monkeypatch):
    for num_splits in (3, 7, 16):
        test_splits_read_the_context_once_and_evenly(num_splits, monkeypatch)


def check_ragged_contexts_in_3_splits(monkeypatch):
    test_ragged_contexts(1, 3)


def check_several_causal_query_tokens(monkeypatch):
    test_several_query_tokens(4, causal=True)


def check_large_scores(monkeypatch):
    test_large_scores_merge_without_overflow()


@builds_on_the_engine
@pytest.mark.parametrize("name, wrong, check", [
    ("split_range", split_0_reads_everything, check_splits),
    ("split_range", splits_that_overlap_by_a_tile, check_splits),
    ("split_range", splits_that_overlap_by_a_tile, check_ragged_contexts_in_3_splits),
    ("split_range", splits_ignoring_min_split_tokens, check_splits),
    ("split_range", splits_of_fewer_programs, check_splits),
    ("online_softmax_update", softmax_step_without_the_rescale, check_ragged_contexts_in_3_splits),
    ("_attend_split", split_that_reads_nothing, check_ragged_contexts_in_3_splits),
    ("_attend_split", split_without_the_causal_mask, check_several_causal_query_tokens),
    ("merge_split_outputs", merge_by_the_plain_mean, check_ragged_contexts_in_3_splits),
    ("merge_split_outputs", merge_without_the_max, check_large_scores),
    ("merge_split_outputs", merge_that_is_nan_when_every_split_is_empty, check_ragged_contexts_in_3_splits),
    ("merge_splits_kernel", merge_kernel_with_zero_padding, check_ragged_contexts_in_3_splits),
], ids=case_id)
def test_the_decode_checks_reject_a_wrong_split_or_merge(name, wrong, check, monkeypatch):
    # 06.1 is the split's range and loop and the merge kernel: a wrong piece of any is a wrong answer.
    ck.fresh_kernels(monkeypatch, decode_module)
    rejected(lambda: check(monkeypatch), decode_module, name, wrong)


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
@pytest.mark.parametrize("batch, max_context", [(1, 32768), (8, 4096)])
def test_fused_merge_in_a_cuda_graph_gpu(batch, max_context):
    """The fused merge replayed from a CUDA graph, with new contexts each time: the two-kernel merge's bits
    (many programs finishing in any order), and the counters back at zero after every replay."""
    # The table and caches cover max_context for every sequence: each replay draws new lengths up to it
    # (a table sized for the first draw only sent the kernel past its rows: an illegal address on the GPU).
    k_cache, v_cache, block_table = paged_cache([max_context] * batch, 16, 8, 128, torch.bfloat16)
    q = randn(batch, 1, 16, 128, dtype=torch.bfloat16)
    seqlens = torch.randint(1, max_context + 1, (batch,), dtype=torch.int32).to(DEVICE)
    config = decode_module.decode_config(128, q.device)
    fused = dataclasses.replace(config, fused_merge=True)
    num_splits = decode_module.decode_num_splits(batch, 8, max_context, q.device, config)
    assert num_splits > 1

    def run(cfg):
        return paged_decode_launch(q, k_cache, v_cache, seqlens, block_table, None, True, num_splits, cfg)

    run(fused)  # compile, and the counters allocated, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(fused)
    for _ in range(3):
        seqlens.copy_(torch.randint(1, max_context + 1, (batch,), dtype=torch.int32))
        graph.replay()
        assert torch.equal(out, run(config))
        assert not common_module.zeroed_counters(q.device, "paged decode's merge").any()


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
