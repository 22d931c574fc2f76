"""The alignment step of the fused MoE kernel, graded for chapter 16's exercise: exact
sorted_token_ids, expert_ids and num_tokens_post_padded against moe_align_block_size_ref on ragged
routings (experts with no pair, experts with an exact multiple of BLOCK_M pairs, top-1/2/8, BLOCK_M
16 and 64, int32 and int64 ids, no tokens at all), sizes that depend on the shapes only, then
fused_moe running on the alignment (and, on a GPU, the alignment captured in a CUDA graph).

With tests/test_kernels_moe.py they grade exercise 16.1 (moe_align_block_size); the known wrong
answers at the end must fail them (the grader can fail).
"""
import importlib

import pytest
import torch

import conftest_kernels as ck  # noqa: I001 (sets TRITON_INTERPRET before triton is imported)
from conftest_kernels import DEVICE, needs_cuda, randn
from wrong_answers import builds_on_the_engine, case_id, rejected

# Reached by its full name, and each call through the module: the exercise switch replaces the attribute.
moe = importlib.import_module("minivllm.kernels.fused_moe")
FIELDS = ("sorted_token_ids", "expert_ids", "num_tokens_post_padded")


def align(topk_ids, num_experts, block_m):
    return moe.moe_align_block_size(topk_ids, num_experts, block_m)


def routed(num_tokens, num_experts, top_k, ids_dtype=torch.int32, experts=None, seed=0):
    """topk_ids [num_tokens, top_k] of a router on random logits: top_k distinct experts per token;
    experts: only these can be picked (the others get no pair)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.rand(num_tokens, num_experts, generator=g)
    if experts is not None:
        allowed = torch.zeros(num_experts, dtype=torch.bool)
        allowed[list(experts)] = True
        logits = logits.masked_fill(~allowed, -1.0)
    return logits.topk(top_k, dim=-1).indices.to(ids_dtype).to(DEVICE)


def assert_alignment(actual, expected):
    assert isinstance(actual, moe.MoEAlignment), f"return a MoEAlignment, got {type(actual).__name__}"
    for name in FIELDS:
        a, e = getattr(actual, name), getattr(expected, name)
        assert a.dtype == torch.int32, f"{name} must be int32, got {a.dtype}"
        assert a.device == e.device, f"{name} must be on {e.device}, got {a.device}"
        assert a.shape == e.shape, f"{name} has shape {tuple(a.shape)}, expected {tuple(e.shape)}"
        assert torch.equal(a, e), f"{name}:\n{a.tolist()}\n!= expected\n{e.tolist()}"


def check_against_reference(topk_ids, num_experts, block_m):
    expected = moe.moe_align_block_size_ref(topk_ids, num_experts, block_m)
    assert_alignment(align(topk_ids, num_experts, block_m), expected)


# ----------------------------------------------------------------------------------- exact layouts
def test_the_chapters_picture():
    """Chapter 16's diagram: BLOCK_M 4; expert 0 gets pairs 0, 3, 6, expert 1 none, expert 2 gets
    1, 2, 4, 5, 7. Sentinel 8 = M * topk; 8 + min(3, 8) * 3 = 17 rows, rounded up to 20."""
    topk_ids = torch.tensor([[0, 2], [2, 0], [2, 2], [0, 2]], dtype=torch.int32, device=DEVICE)
    out = align(topk_ids, 3, 4)
    assert out.sorted_token_ids.tolist() == [0, 3, 6, 8, 1, 2, 4, 5, 7, 8, 8, 8] + [8] * 8
    assert out.expert_ids.tolist() == [0, 2, 2, -1, -1]
    assert out.num_tokens_post_padded.tolist() == [12]


def test_an_exact_multiple_of_block_m_takes_no_extra_tile():
    """Expert 0 gets 16 pairs (one whole tile), expert 1 none, expert 2 32 (two), expert 3 5."""
    ids = [0] * 16 + [2] * 32 + [3] * 5
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(1))
    topk_ids = torch.tensor(ids, dtype=torch.int64)[order].view(-1, 1).to(DEVICE)  # top-1, 53 tokens
    out = align(topk_ids, 4, 16)
    assert out.num_tokens_post_padded.tolist() == [16 + 32 + 16]
    assert out.expert_ids[:4].tolist() == [0, 2, 2, 3]
    check_against_reference(topk_ids, 4, 16)


def test_experts_without_pairs_own_no_tile():
    """Experts 0, 5 and 15 get no pair: no tile, no padding row; the others' tiles follow in order."""
    topk_ids = routed(37, 16, 2, experts=[1, 2, 3, 4, 6, 9, 14])
    check_against_reference(topk_ids, 16, 16)
    out = align(topk_ids, 16, 16)
    num_tiles = out.num_tokens_post_padded.item() // 16
    assert out.expert_ids[:num_tiles].tolist() == sorted(out.expert_ids[:num_tiles].tolist())
    assert set(out.expert_ids[:num_tiles].tolist()) == {1, 2, 3, 4, 6, 9, 14}


def test_one_expert_id_per_tile():
    """5 tokens, top-2, 4 experts, BLOCK_M 16: each expert used gets one tile of 16 rows."""
    topk_ids = torch.tensor([[3, 1], [1, 3], [0, 3], [3, 1], [1, 0]], dtype=torch.int32, device=DEVICE)
    out = align(topk_ids, 4, 16)
    # 10 pairs + min(4, 10) * 15 = 70 rows -> 80: five tiles, three used (experts 0, 1, 3; 2 has none)
    assert out.expert_ids.tolist() == [0, 1, 3, -1, -1]
    assert out.sorted_token_ids[:16].tolist() == [4, 9] + [10] * 14
    assert out.sorted_token_ids[16:32].tolist() == [1, 2, 7, 8] + [10] * 12
    assert out.sorted_token_ids[32:48].tolist() == [0, 3, 5, 6] + [10] * 12
    assert out.sorted_token_ids[48:].tolist() == [10] * 32


def test_pairs_keep_their_order_within_an_expert():
    """Within an expert the pair ids increase (topk_ids.flatten()'s order), across tokens and slots."""
    topk_ids = routed(200, 4, 2, ids_dtype=torch.int64)
    out = align(topk_ids, 4, 64)
    ids = out.sorted_token_ids.cpu()
    real = ids[ids < 400]
    for e in range(4):
        mine = real[topk_ids.flatten().cpu()[real.long()] == e]
        assert mine.tolist() == sorted(mine.tolist()) and len(mine) == int((topk_ids == e).sum())
    check_against_reference(topk_ids, 4, 64)


@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m, ids_dtype", [
    (1, 8, 1, 16, torch.int32), (1, 128, 8, 16, torch.int64), (7, 8, 2, 16, torch.int64),
    (33, 64, 8, 16, torch.int32), (100, 128, 8, 64, torch.int64), (257, 16, 2, 64, torch.int32),
    (64, 4, 1, 16, torch.int32),
])
def test_ragged_routings_match_the_reference(num_tokens, num_experts, top_k, block_m, ids_dtype):
    check_against_reference(routed(num_tokens, num_experts, top_k, ids_dtype), num_experts, block_m)


def test_no_tokens():
    out = align(torch.zeros(0, 8, dtype=torch.int32, device=DEVICE), 128, 16)
    assert out.sorted_token_ids.numel() == 0 and out.expert_ids.numel() == 0
    assert out.num_tokens_post_padded.tolist() == [0] and out.num_tokens_post_padded.dtype == torch.int32


def test_sizes_depend_on_the_shapes_only():
    """Two routings of one shape (all 8 pairs on one expert; 8 experts hit) give buffers of one size,
    moe_padded_size's, and only num_tokens_post_padded differs: what a CUDA graph needs."""
    same = torch.zeros(8, 1, dtype=torch.int32, device=DEVICE)
    spread = torch.arange(8, dtype=torch.int32, device=DEVICE).view(8, 1)
    a, b = align(same, 8, 16), align(spread, 8, 16)
    size = moe.moe_padded_size(8, 8, 16)
    assert a.sorted_token_ids.shape == b.sorted_token_ids.shape == (size,)
    assert a.expert_ids.shape == b.expert_ids.shape == (size // 16,)
    assert a.num_tokens_post_padded.tolist() == [16] and b.num_tokens_post_padded.tolist() == [128]
    assert a.sorted_token_ids.tolist() == list(range(8)) + [8] * (size - 8)


# ------------------------------------------------------------------------------- in the kernel
def test_fused_moe_runs_on_the_alignment():
    """The GEMMs read the tiles the alignment lays out: fused_moe equals the per-expert reference
    (experts 3 and 6 get no pair; in Triton's interpreter on a CPU)."""
    num_tokens, num_experts, top_k, hidden_size, intermediate_size = 23, 8, 2, 32, 48
    topk_ids = routed(num_tokens, num_experts, top_k, experts=[0, 1, 2, 4, 5, 7])
    topk_weights = torch.rand(num_tokens, top_k, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    x = randn(num_tokens, hidden_size, dtype=torch.float32)
    w13 = randn(num_experts, 2 * intermediate_size, hidden_size, dtype=torch.float32) * hidden_size**-0.5
    w2 = randn(num_experts, hidden_size, intermediate_size, dtype=torch.float32) * intermediate_size**-0.5
    expected = moe.fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
    ck.assert_close(moe.fused_moe(x, w13, w2, topk_weights, topk_ids), expected)


@needs_cuda
def test_the_alignment_replays_in_a_cuda_graph():
    """Captured once, replayed on new routings written in place: no host sync, nothing baked in."""
    topk_ids = routed(64, 128, 8)
    align(topk_ids, 128, 16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = align(topk_ids, 128, 16)
    for seed, experts in ((1, None), (2, range(8)), (3, [0, 5, 127, 64, 9, 10, 11, 12])):
        topk_ids.copy_(routed(64, 128, 8, experts=experts, seed=seed))
        graph.replay()
        assert_alignment(out, moe.moe_align_block_size_ref(topk_ids, 128, 16))


# --------------------------------------------------------------------------------------------------
# Known wrong answers: each must fail a check that grades exercise 16.1
# --------------------------------------------------------------------------------------------------

def _align(topk_ids, num_experts, block_m, pad="cdiv", order="pair", ids="pair", sentinel="num_pairs",
           expert_ids_per="tile", size="bound", tail_expert=-1):
    """moe_align_block_size in torch with one piece swappable (the wrong answers below)."""
    flat, device = topk_ids.flatten().long(), topk_ids.device
    num_tokens, top_k = topk_ids.shape
    num_pairs = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    tiles = (counts + block_m - 1) // block_m
    padded = {"cdiv": tiles * block_m, "none": counts, "empty too": tiles.clamp(min=1) * block_m,
              "always": torch.where(counts > 0, (counts // block_m + 1) * block_m, 0)}[pad]
    padded_end = padded.cumsum(0)
    num_post = int(padded_end[-1])
    p = torch.arange(num_pairs, device=device)
    within = {"pair": p, "slot-major": (p % top_k) * num_tokens + p // top_k, "reversed": -p}[order]
    by_expert = (flat * 2 * num_pairs + within).argsort()  # pair ids by expert, then by `within`
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[flat[by_expert]]
    rows = (padded_end - padded)[flat[by_expert]] + rank
    fill = {"num_pairs": num_pairs, "num_tokens": num_tokens, "-1": -1}[sentinel]
    bound = moe.moe_padded_size(num_pairs, num_experts, block_m)
    total = -(-num_post // block_m) * block_m if size == "data" else max(bound, -(-num_post // block_m) * block_m)
    sorted_token_ids = torch.full((total,), fill, dtype=torch.int32, device=device)
    sorted_token_ids[rows] = (by_expert // top_k if ids == "token" else by_expert).to(torch.int32)
    if expert_ids_per == "pair":  # one id per row (pair or padding), then the tail
        expert_ids = torch.full((total,), tail_expert, dtype=torch.int32, device=device)
        expert_ids[:num_post] = torch.repeat_interleave(torch.arange(num_experts, device=device), padded).int()
    else:
        starts = torch.arange(0, total, block_m, device=device)
        owner = torch.searchsorted(padded_end, starts, right=True)
        expert_ids = torch.where(starts < num_post, owner, tail_expert).to(torch.int32)
    return moe.MoEAlignment(sorted_token_ids, expert_ids, torch.tensor([num_post], dtype=torch.int32, device=device))


def align_without_padding(topk_ids, num_experts, block_m):
    return _align(topk_ids, num_experts, block_m, pad="none")


def align_with_a_whole_extra_tile_when_aligned(topk_ids, num_experts, block_m):
    return _align(topk_ids, num_experts, block_m, pad="always")


def align_with_a_tile_for_empty_experts(topk_ids, num_experts, block_m):
    return _align(topk_ids, num_experts, block_m, pad="empty too")


def align_with_expert_ids_per_pair(topk_ids, num_experts, block_m):
    return _align(topk_ids, num_experts, block_m, expert_ids_per="pair")


def align_slot_major_within_an_expert(topk_ids, num_experts, block_m):
    """Within an expert, slot 0 of every token first, then slot 1, ... (a loop over topk's columns)."""
    return _align(topk_ids, num_experts, block_m, order="slot-major")


def align_in_reverse_within_an_expert(topk_ids, num_experts, block_m):
    return _align(topk_ids, num_experts, block_m, order="reversed")


def align_with_token_ids(topk_ids, num_experts, block_m):
    """sorted_token_ids holding p // topk, the token, instead of the pair p (the name invites it)."""
    return _align(topk_ids, num_experts, block_m, ids="token")


def align_with_sentinel_num_tokens(topk_ids, num_experts, block_m):
    return _align(topk_ids, num_experts, block_m, sentinel="num_tokens")


def align_with_sentinel_minus_one(topk_ids, num_experts, block_m):
    return _align(topk_ids, num_experts, block_m, sentinel="-1")


def align_sized_by_the_routing(topk_ids, num_experts, block_m):
    """Buffers just large enough for this routing (num_tokens_post_padded read on the host)."""
    return _align(topk_ids, num_experts, block_m, size="data")


def align_with_expert_0_past_the_end(topk_ids, num_experts, block_m):
    return _align(topk_ids, num_experts, block_m, tail_expert=0)


def check_ragged_routings():
    for case in [(1, 8, 1, 16, torch.int32), (7, 8, 2, 16, torch.int64), (33, 64, 8, 16, torch.int32),
                 (257, 16, 2, 64, torch.int32)]:
        test_ragged_routings_match_the_reference(*case)


def test_the_alignment_as_the_wrong_answers_write_it_passes():
    """_align with no piece swapped is right: the wrong answers below differ from it in one thing."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moe, "moe_align_block_size", _align)
        test_the_chapters_picture()
        test_an_exact_multiple_of_block_m_takes_no_extra_tile()
        test_experts_without_pairs_own_no_tile()
        test_one_expert_id_per_tile()
        test_pairs_keep_their_order_within_an_expert()
        test_sizes_depend_on_the_shapes_only()
        check_ragged_routings()
        test_fused_moe_runs_on_the_alignment()


@builds_on_the_engine
@pytest.mark.parametrize("wrong, check", [
    (align_without_padding, test_the_chapters_picture),
    (align_without_padding, test_fused_moe_runs_on_the_alignment),
    (align_with_a_whole_extra_tile_when_aligned, test_an_exact_multiple_of_block_m_takes_no_extra_tile),
    (align_with_a_tile_for_empty_experts, test_experts_without_pairs_own_no_tile),
    (align_with_expert_ids_per_pair, test_one_expert_id_per_tile),
    (align_with_expert_ids_per_pair, check_ragged_routings),
    (align_slot_major_within_an_expert, test_pairs_keep_their_order_within_an_expert),
    (align_in_reverse_within_an_expert, test_pairs_keep_their_order_within_an_expert),
    (align_in_reverse_within_an_expert, check_ragged_routings),
    (align_with_token_ids, test_one_expert_id_per_tile),
    (align_with_token_ids, test_fused_moe_runs_on_the_alignment),
    (align_with_sentinel_num_tokens, test_the_chapters_picture),
    (align_with_sentinel_minus_one, check_ragged_routings),
    (align_sized_by_the_routing, test_sizes_depend_on_the_shapes_only),
    (align_with_expert_0_past_the_end, test_the_chapters_picture),
], ids=case_id)
def test_the_checks_reject_a_wrong_alignment(wrong, check):
    rejected(check, moe, "moe_align_block_size", wrong)
