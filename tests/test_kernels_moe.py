"""fused_moe (Triton) against fused_moe_ref, and moe_align_block_size against its reference: ragged
token counts, 8 to 128 experts, top-1 to top-8, experts that get no token, int32 and int64 ids."""
import importlib

import pytest
import torch

import conftest_kernels as ck  # noqa: I001 (sets TRITON_INTERPRET before triton is imported)
from conftest_kernels import DEVICE, DTYPES, needs_cuda, randn

# Reached by its full name: kernels/__init__.py may export a function of the same name.
moe = importlib.import_module("minivllm.kernels.fused_moe")
MoEConfig, SmallMoEConfig = moe.MoEConfig, moe.SmallMoEConfig
fused_moe, fused_moe_ref = moe.fused_moe, moe.fused_moe_ref
moe_align_block_size, moe_align_block_size_ref = moe.moe_align_block_size, moe.moe_align_block_size_ref

QWEN3_30B_A3B = dict(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768)  # per expert


class PoisonedBuffers(ck.PoisonedTorch):
    """Float buffers start NaN, integer ones at 2**30: a row the kernels never write, or a slot of the
    alignment the align step never fills, fails the comparison."""

    @staticmethod
    def _poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(2**30)


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(moe, "torch", PoisonedBuffers())


def routing(num_tokens, num_experts, top_k, ids_dtype=torch.int32, experts=None, seed=0):
    """The model's router on N(0, 1) logits: softmax, top-k, renormalised. experts: only these
    experts can be picked (the others get no token). Returns (topk_weights float32, topk_ids)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if experts is not None:
        allowed = torch.zeros(num_experts, dtype=torch.bool)
        allowed[list(experts)] = True
        logits = logits.masked_fill(~allowed, float("-inf"))
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(DEVICE), ids.to(ids_dtype).to(DEVICE)


def moe_inputs(num_tokens, num_experts, top_k, hidden_size, intermediate_size, dtype, **routing_kwargs):
    """hidden_states ~ N(0, 1); weights scaled by 1/sqrt(fan-in) so every stage stays O(1)."""
    x = randn(num_tokens, hidden_size, dtype=dtype)
    w13 = (randn(num_experts, 2 * intermediate_size, hidden_size, dtype=torch.float32) * hidden_size**-0.5).to(dtype)
    w2 = (randn(num_experts, hidden_size, intermediate_size, dtype=torch.float32) * intermediate_size**-0.5).to(dtype)
    return (x, w13, w2, *routing(num_tokens, num_experts, top_k, **routing_kwargs))


def check_moe(inputs, config=None):
    # Both sides round the activation to the input dtype between the projections; the kernel also
    # rounds each slot's weighted output before the sum (1 ulp of fp16 ~ 5e-4 relative, top-k of
    # them), inside conftest_kernels.TOLERANCES. float32 on the GPU runs its dots in tf32.
    expected = fused_moe_ref(*inputs)
    actual = fused_moe(*inputs, config=config)
    assert actual.shape == inputs[0].shape and actual.dtype == inputs[0].dtype
    ck.assert_close(actual, expected)
    return actual


# ----------------------------------------------------------------------------- align

def assert_same_alignment(actual, expected):
    for name in ("sorted_token_ids", "expert_ids", "num_tokens_post_padded"):
        a, e = getattr(actual, name), getattr(expected, name)
        assert a.dtype == e.dtype == torch.int32, name
        assert torch.equal(a.cpu(), e.cpu()), f"{name}:\n{a}\n!=\n{e}"


def test_align_exact_layout():
    """The docstring's picture: BLOCK_M 4, expert 0 gets pairs 0, 3, 6; expert 1 none; expert 2 gets
    1, 2, 4, 5, 7. Sentinel 8 = M * topk pads each expert's last tile and the tail of the buffer."""
    topk_ids = torch.tensor([[0, 2], [2, 0], [2, 2], [0, 2]], dtype=torch.int32, device=DEVICE)
    S = 8
    expected = [0, 3, 6, S, 1, 2, 4, 5, 7, S, S, S] + [S] * 8  # 8 + min(3, 8) * 3 = 17 rows -> 20
    for align in (moe_align_block_size(topk_ids, 3, 4), moe_align_block_size_ref(topk_ids, 3, 4)):
        assert align.sorted_token_ids.tolist() == expected
        assert align.expert_ids.tolist() == [0, 2, 2, -1, -1]
        assert align.num_tokens_post_padded.tolist() == [12]


def check_alignment(topk_ids, num_experts, block_m):
    actual = moe_align_block_size(topk_ids, num_experts, block_m)
    assert_same_alignment(actual, moe_align_block_size_ref(topk_ids, num_experts, block_m))
    # what the GEMMs rely on: every pair exactly once, each tile of one expert that owns its pairs
    num_post = actual.num_tokens_post_padded.item()
    ids = actual.sorted_token_ids[:num_post].cpu()
    num_pairs = topk_ids.numel()
    assert num_post % block_m == 0 and sorted(ids[ids < num_pairs].tolist()) == list(range(num_pairs))
    tile_experts = actual.expert_ids[:num_post // block_m].cpu().repeat_interleave(block_m)
    real = ids < num_pairs
    assert torch.equal(topk_ids.flatten().cpu()[ids[real].long()].int(), tile_experts[real])
    return actual


@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m, ids_dtype", [
    (1, 8, 1, 16, torch.int32), (7, 8, 2, 16, torch.int64), (233, 64, 8, 16, torch.int32),
    (1000, 128, 8, 64, torch.int64),
])
def test_align_matches_reference(num_tokens, num_experts, top_k, block_m, ids_dtype):
    check_alignment(routing(num_tokens, num_experts, top_k, ids_dtype)[1], num_experts, block_m)


def test_align_several_pieces_per_chunk(monkeypatch):
    """At most 4 chunks: 1,864 pairs in chunks of 8 pieces of 64, counted and placed piece by piece
    (the path of M * topk > 64 * ALIGN_MAX_CHUNKS = 16,384 pairs, on fewer pairs)."""
    monkeypatch.setattr(moe, "ALIGN_MAX_CHUNKS", 4)
    check_alignment(routing(233, 16, 8)[1], 16, 32)


def test_align_experts_without_tokens():
    """Experts 0, 5 and the last get no token: they own no tile, and the others' tiles follow in order."""
    _, topk_ids = routing(37, 16, 2, experts=[1, 2, 3, 4, 6, 9, 14])
    align = check_alignment(topk_ids, 16, 16)
    num_tiles = align.num_tokens_post_padded.item() // 16
    used = align.expert_ids[:num_tiles].tolist()
    assert used == sorted(used) and set(used) == set(topk_ids.flatten().tolist()) <= {1, 2, 3, 4, 6, 9, 14}
    assert set(align.expert_ids[num_tiles:].tolist()) <= {-1}


# ----------------------------------------------------------------------------- fused_moe

# (M, E, top-k, K, N, dtype): ragged M, E = 8 / 64 / 128, top-1 / 2 / 8, small K and N for the
# interpreter, each dtype on several shapes (not the full product: the interpreter is slow).
F16, F32 = torch.float16, torch.float32
CASES = [(1, 8, 2, 32, 32, F32), (7, 8, 2, 64, 48, F16), (233, 8, 2, 64, 48, F32), (33, 64, 8, 32, 32, F16),
         (7, 128, 8, 32, 32, F32), (16, 128, 1, 32, 32, F16)]


@pytest.mark.parametrize("num_tokens, num_experts, top_k, hidden_size, intermediate_size, dtype", CASES)
def test_fused_moe_matches_reference(num_tokens, num_experts, top_k, hidden_size, intermediate_size, dtype):
    check_moe(moe_inputs(num_tokens, num_experts, top_k, hidden_size, intermediate_size, dtype))


@needs_cuda
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(7, 8, 2), (233, 64, 8), (1000, 128, 8)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe_gpu_dtypes(num_tokens, num_experts, top_k, dtype):
    check_moe(moe_inputs(num_tokens, num_experts, top_k, 256, 192, dtype))


def test_fused_moe_1000_tokens_wide_tiles():
    """M = 1000 with an explicit config: 64-row tiles, a K step that leaves a ragged last step."""
    config = MoEConfig(BLOCK_M=64, BLOCK_N=32, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=1)
    check_moe(moe_inputs(1000, 8, 1, 96, 32, torch.float32), config)


# Both paths on the same inputs, whichever moe_config would choose: the few-pairs path on many pairs too
# (ragged N and K against its tiles), the aligned path on a single token.
# The few-pairs path in both forms: a sum per reduction step, and the products summed once after the loop.
SMALL, ALIGNED = SmallMoEConfig(BLOCK_N=16, BLOCK_K=32), MoEConfig(16, 32, 32, 1, 4, 1)
SMALL_ONCE = SmallMoEConfig(BLOCK_N=8, BLOCK_K=32, sum_once=True)
FEW_PAIRS = pytest.mark.parametrize("config", [SMALL, SMALL_ONCE], ids=["few-pairs", "few-pairs-sum-once"])


@pytest.mark.parametrize("num_tokens, num_experts, top_k, hidden_size, intermediate_size, dtype", [
    (1, 128, 8, 48, 40, F32), (3, 8, 2, 32, 32, F16), (233, 64, 8, 40, 24, F32)])
@pytest.mark.parametrize("config", [SMALL, SMALL_ONCE, ALIGNED], ids=["few-pairs", "few-pairs-sum-once", "aligned"])
def test_fused_moe_both_paths(num_tokens, num_experts, top_k, hidden_size, intermediate_size, dtype, config):
    check_moe(moe_inputs(num_tokens, num_experts, top_k, hidden_size, intermediate_size, dtype), config)


@FEW_PAIRS
def test_fused_moe_few_pairs_leaves_out_expert_ids_outside_the_range(config):
    """An id outside [0, E) adds nothing (the reference's loop over the experts never meets it) and
    reads nothing out of bounds; the token's other slots still count. (The router's top-k never makes
    one; the aligned path leaves such a pair's row unwritten: see fused_moe's docstring.)"""
    x, w13, w2, weights, ids = moe_inputs(3, 8, 2, 32, 32, torch.float32)
    ids[0, 1], ids[2, 0] = 8, -1
    expected = fused_moe_ref(x, w13, w2, weights, ids)
    assert expected[0].abs().sum() > 0 and expected[1].abs().sum() > 0
    ck.assert_close(fused_moe(x, w13, w2, weights, ids, config=config), expected)


@FEW_PAIRS
def test_fused_moe_few_pairs_sums_each_token_once(config):
    """The few-pairs path's property: no align, and each token's output is the weighted sum of its
    own slots only. Zeroing one token's routing weights zeroes that row and no other."""
    x, w13, w2, weights, ids = moe_inputs(4, 16, 2, 32, 32, torch.float32)
    weights[2] = 0.0
    out = fused_moe(x, w13, w2, weights, ids, config=config)
    assert torch.count_nonzero(out[2]) == 0 and all(torch.count_nonzero(out[i]) == 32 for i in (0, 1, 3))
    ck.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids))


def test_fused_moe_experts_without_tokens():
    """Only 3 of 64 experts are picked (all of a token's top-3 are those): the rest get no tile."""
    check_moe(moe_inputs(9, 64, 3, 32, 32, torch.float16, experts=[0, 17, 63]))


def test_fused_moe_int32_and_int64_ids_agree():
    inputs = moe_inputs(13, 8, 2, 32, 32, torch.float32)
    as_int32 = fused_moe(*inputs)
    as_int64 = fused_moe(*inputs[:4], inputs[4].long())
    assert torch.equal(as_int32, as_int64)
    ck.assert_close(as_int64, fused_moe_ref(*inputs[:4], inputs[4].long()))


def test_fused_moe_no_tokens():
    out = fused_moe(*moe_inputs(0, 8, 2, 32, 32, torch.float16))
    assert out.shape == (0, 32) and out.dtype == torch.float16


def test_fused_moe_argument_errors():
    x, w13, w2, weights, ids = moe_inputs(3, 4, 2, 32, 16, torch.float32)
    with pytest.raises(AssertionError, match=r"w13 must be \[E, 2N, K=32\]"):
        fused_moe(x, w13[:, :, :16], w2, weights, ids)
    with pytest.raises(AssertionError, match=r"w2 must be \[E, K, N\]"):
        fused_moe(x, w13, w2.transpose(1, 2), weights, ids)
    with pytest.raises(AssertionError, match="must share a dtype"):
        fused_moe(x.half(), w13, w2, weights, ids)
    with pytest.raises(AssertionError, match="not supported"):
        fused_moe(x.double(), w13.double(), w2.double(), weights, ids)
    with pytest.raises(AssertionError, match="topk_weights must be float32"):
        fused_moe(x, w13, w2, weights.half(), ids)
    with pytest.raises(AssertionError, match="topk_ids must be int32 or int64"):
        fused_moe(x, w13, w2, weights, ids.float())
    with pytest.raises(AssertionError, match="topk_ids has 2 rows, hidden_states 3"):
        fused_moe(x, w13, w2, weights[:2], ids[:2])
    with pytest.raises(AssertionError, match=r"hidden_states must be \[M, K\]"):
        fused_moe(x[None], w13, w2, weights, ids)
    with pytest.raises(AssertionError, match="contiguous in its last dim"):
        fused_moe(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, weights, ids)
    with pytest.raises(AssertionError, match="must be contiguous"):
        fused_moe(x, w13, w2, weights, torch.cat([ids, ids], dim=1)[:, ::2])
    with pytest.raises(AssertionError, match="must be a power of two >= 16"):
        MoEConfig(BLOCK_M=24, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=1)


def test_moe_config_grows_with_rows_per_expert(monkeypatch):
    """The GPU chooser (the interpreter's fixed small tiles set aside): 16-row tiles for decode,
    wider ones as each expert's share of M * topk grows."""
    monkeypatch.setattr(moe, "is_interpreter", lambda: False)
    block_m = [moe.moe_config(m, 128, 768, 2048, 8, torch.bfloat16).BLOCK_M for m in (5, 64, 256, 1024, 16384)]
    assert block_m == sorted(block_m) and block_m[0] == 16 and block_m[-1] == 128


def test_moe_config_takes_the_few_pairs_path_up_to_its_pair_count(monkeypatch):
    monkeypatch.setattr(moe, "is_interpreter", lambda: False)
    limit = moe.SMALL_MAX_PAIRS
    assert isinstance(moe.moe_config(limit // 8, 128, 768, 2048, 8, torch.bfloat16), SmallMoEConfig)
    assert isinstance(moe.moe_config(limit // 8 + 1, 128, 768, 2048, 8, torch.bfloat16), MoEConfig)
    assert isinstance(moe.moe_config(limit, 8, 64, 64, 1, torch.float32), SmallMoEConfig)


# ----------------------------------------------------------------------------- GPU only

@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 16, 256, 4096])
def test_fused_moe_qwen3_30b_a3b_bf16(num_tokens):
    s = QWEN3_30B_A3B
    check_moe(moe_inputs(num_tokens, s["num_experts"], s["top_k"], s["hidden_size"], s["intermediate_size"],
                         torch.bfloat16))


@needs_cuda
@pytest.mark.parametrize("config", [SmallMoEConfig(8, 256, 4, True), SmallMoEConfig(2, 1024, 4, True)],
                         ids=["8x256", "2x1024"])
@pytest.mark.parametrize("num_tokens", [1, 4])
def test_fused_moe_few_pairs_sum_once_qwen3_30b_a3b_bf16(num_tokens, config):
    """The tuner's sum-once tiles at the real shapes, in bf16 (the interpreter's tests run fp32/fp16)."""
    s = QWEN3_30B_A3B
    check_moe(moe_inputs(num_tokens, s["num_experts"], s["top_k"], s["hidden_size"], s["intermediate_size"],
                         torch.bfloat16), config)


@needs_cuda
@pytest.mark.parametrize("num_tokens", [2, 64], ids=["few-pairs", "aligned"])
def test_fused_moe_cuda_graph_replays_new_routing(num_tokens):
    """Captured once, replayed after the inputs change in place, the routing too (spread over all
    experts, then every token on the same 8): nothing of the first routing is baked into the graph."""
    x, w13, w2, weights, ids = moe_inputs(num_tokens, 128, 8, 256, 128, torch.bfloat16)
    fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    for seed, experts in ((1, None), (2, range(8)), (3, [5, 6, 7, 8, 9, 10, 11, 127])):
        new_weights, new_ids = routing(num_tokens, 128, 8, experts=experts, seed=seed)
        x.copy_(randn(num_tokens, 256, dtype=torch.bfloat16))
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        ck.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids))
