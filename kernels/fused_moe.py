"""Fused mixture-of-experts MLP: each token goes through the SwiGLU MLPs of its top-k experts, and
the results are summed with the router's weights. Two grouped GEMMs over tokens sorted by expert.

An align step (a counting sort) groups the (token, slot) pairs by expert in BLOCK_M-row tiles, one
expert per tile; kernel 1 multiplies each tile by its expert's gate and up projections and applies
SiLU-and-mul in its epilogue; kernel 2 multiplies by the down projection and the routing weight.
vLLM: vllm/model_executor/layers/fused_moe/fused_moe.py (fused_moe_kernel, fused_experts) and
vllm/model_executor/layers/fused_moe/moe_align_block_size.py (csrc/moe/moe_align_sum_kernels.cu).
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import is_interpreter

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TOPK_ID_DTYPES = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------- references

def fused_moe_ref(hidden_states, w13, w2, topk_weights, topk_ids):
    """Naive reference: a loop over the experts, float32 matmuls.

    hidden_states [M, K]; w13 [E, 2N, K] (rows 0:N the gate projection, N:2N the up projection);
    w2 [E, K, N]; topk_weights [M, topk] float32; topk_ids [M, topk] int. Returns [M, K] in
    hidden_states.dtype:

        out[m] = sum_j topk_weights[m, j] * w2[e] @ (silu(w13[e, :N] @ x[m]) * (w13[e, N:] @ x[m])),
                 e = topk_ids[m, j]

    The activation between the two projections is rounded to the input dtype, as the kernel stores
    it (and as a bf16 model's MLP holds it); everything else is float32, rounded once at the end.
    """
    _check_moe_arguments(hidden_states, w13, w2, topk_weights, topk_ids)
    num_experts, two_n, _ = w13.shape
    n = two_n // 2
    x = hidden_states.float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [M, K]
    for e in range(num_experts):
        token_idx, slot = (topk_ids == e).nonzero(as_tuple=True)  # the pairs routed to expert e
        if token_idx.numel() == 0:
            continue
        h = x[token_idx]  # [n_e, K]
        gate, up = h @ w13[e, :n].float().t(), h @ w13[e, n:].float().t()  # each [n_e, N]
        act = (F.silu(gate) * up).to(hidden_states.dtype).float()
        y = act @ w2[e].float().t()  # [n_e, K]
        out.index_add_(0, token_idx, y * topk_weights[token_idx, slot, None])
    return out.to(hidden_states.dtype)


@dataclass
class MoEAlignment:
    """The (token, slot) pairs sorted by expert, each expert's rows padded to whole BLOCK_M tiles.

    Pair p = token * topk + slot (topk_ids.flatten()'s index). With BLOCK_M = 4, experts 0 and 2
    hit by 3 and 5 pairs, expert 1 by none (sentinel S = M * topk):

        sorted_token_ids  [ p p p S | p p p p | p S S S | S S ... S ]   sized for the worst case
        expert_ids        [    0    |    2    |    2    |   -1 ...  ]   one per tile
        num_tokens_post_padded = 12 (on the device: the GEMMs' programs past it return at once)

    Within an expert the pairs keep their order in topk_ids.flatten(). Sizes depend on shapes only:
    moe_padded_size(); slots and tiles past num_tokens_post_padded hold S and -1 and are never read.
    """
    sorted_token_ids: torch.Tensor  # [max_num_padded] int32
    expert_ids: torch.Tensor  # [max_num_padded // block_m] int32
    num_tokens_post_padded: torch.Tensor  # [1] int32


def moe_padded_size(num_pairs, num_experts, block_m):
    """Upper bound of the padded row count: every expert that gets a pair pads by < block_m rows,
    and at most min(num_experts, num_pairs) experts get one. A multiple of block_m."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


def moe_align_block_size_ref(topk_ids, num_experts, block_m):
    """Naive reference for `moe_align_block_size`: a Python loop over the experts (syncs the host)."""
    _check_align_arguments(topk_ids, num_experts, block_m)
    pairs = topk_ids.flatten().tolist()
    num_pairs = len(pairs)
    sentinel = num_pairs
    sorted_ids, expert_ids = [], []
    for e in range(num_experts):
        mine = [p for p, expert in enumerate(pairs) if expert == e]
        if not mine:
            continue
        num_tiles = triton.cdiv(len(mine), block_m)
        sorted_ids += mine + [sentinel] * (num_tiles * block_m - len(mine))
        expert_ids += [e] * num_tiles
    num_post_padded = len(sorted_ids)
    max_num_padded = moe_padded_size(num_pairs, num_experts, block_m)
    sorted_ids += [sentinel] * (max_num_padded - num_post_padded)
    expert_ids += [-1] * (max_num_padded // block_m - len(expert_ids))
    as_int32 = lambda values: torch.tensor(values, dtype=torch.int32, device=topk_ids.device)  # noqa: E731
    return MoEAlignment(as_int32(sorted_ids), as_int32(expert_ids), as_int32([num_post_padded]))


def _check_align_arguments(topk_ids, num_experts, block_m):
    assert topk_ids.dim() == 2, f"topk_ids must be [num_tokens, topk], got shape {tuple(topk_ids.shape)}"
    assert topk_ids.dtype in TOPK_ID_DTYPES, f"topk_ids must be int32 or int64, got {topk_ids.dtype}"
    assert num_experts >= 1, f"num_experts must be >= 1, got {num_experts}"
    assert block_m >= 1, f"block_m must be >= 1, got {block_m}"


def _check_moe_arguments(hidden_states, w13, w2, topk_weights, topk_ids):
    assert hidden_states.dim() == 2, f"hidden_states must be [M, K], got shape {tuple(hidden_states.shape)}"
    num_tokens, hidden_size = hidden_states.shape
    assert w13.dim() == 3 and w13.shape[1] % 2 == 0 and w13.shape[2] == hidden_size, (
        f"w13 must be [E, 2N, K={hidden_size}] (gate rows, then up rows), got {tuple(w13.shape)}")
    num_experts, two_n, _ = w13.shape
    assert w2.shape == (num_experts, hidden_size, two_n // 2), (
        f"w2 must be [E, K, N] = {(num_experts, hidden_size, two_n // 2)}, got {tuple(w2.shape)}")
    assert hidden_states.dtype in SUPPORTED_DTYPES, (
        f"hidden_states dtype {hidden_states.dtype} not supported (use one of {SUPPORTED_DTYPES})")
    assert w13.dtype == w2.dtype == hidden_states.dtype, (
        f"hidden_states, w13 and w2 must share a dtype, got {hidden_states.dtype}, {w13.dtype}, {w2.dtype}")
    _check_align_arguments(topk_ids, num_experts, 1)
    assert topk_ids.shape[0] == num_tokens, f"topk_ids has {topk_ids.shape[0]} rows, hidden_states {num_tokens}"
    assert topk_weights.shape == topk_ids.shape and topk_weights.dtype == torch.float32, (
        f"topk_weights must be float32 {tuple(topk_ids.shape)} like topk_ids, "
        f"got {topk_weights.dtype} {tuple(topk_weights.shape)}")
    devices = {t.device for t in (hidden_states, w13, w2, topk_weights, topk_ids)}
    assert len(devices) == 1, f"all inputs must be on one device, got {devices}"


# ----------------------------------------------------------------------------- align (counting sort)
#
# Three launches, sized by shapes only (CUDA-graph safe). The pairs are cut into chunks of whole
# SUB-pair pieces; a piece is compared against every expert at once (a [SUB, EXPERTS_PAD] one-hot).
#
#   1. count   grid (num_chunks,)  chunk_offsets[c, e] = pairs of chunk c routed to expert e
#   2. scan    grid (1,)           chunk_offsets[c, e] = pairs of expert e in chunks before c (in place);
#                                  expert_starts[e] = first padded row of expert e; the tiles' expert
#                                  ids, num_tokens_post_padded, and the sentinel in every padding slot
#   3. place   grid (num_chunks,)  pair p of expert e, the r-th of e in chunk c, goes to row
#                                  expert_starts[e] + chunk_offsets[c, e] + r: stable within each expert

ALIGN_SUB = 64  # pairs compared against all experts at once
ALIGN_MAX_CHUNKS = 256  # programs of the count and place steps (the scan walks this many rows)


@triton.jit
def _one_hot_experts(topk_ids_ptr, offs, num_pairs, num_experts, EXPERTS_PAD: tl.constexpr):
    """[SUB, EXPERTS_PAD] int32: 1 where pair offs[i] is routed to expert e. Lanes past num_pairs
    and ids outside [0, num_experts) match no expert."""
    ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=-1)
    experts = tl.arange(0, EXPERTS_PAD)
    return ((ids[:, None] == experts[None, :]) & (experts[None, :] < num_experts)).to(tl.int32)


@triton.jit(do_not_specialize=["num_pairs", "chunk_size"])
def moe_align_count_kernel(topk_ids_ptr, chunk_offsets_ptr, num_pairs, num_experts, chunk_size,
                           SUB: tl.constexpr, EXPERTS_PAD: tl.constexpr):
    chunk = tl.program_id(0)
    counts = tl.zeros([EXPERTS_PAD], dtype=tl.int32)
    for start in range(0, chunk_size, SUB):
        offs = chunk * chunk_size + start + tl.arange(0, SUB)
        counts += tl.sum(_one_hot_experts(topk_ids_ptr, offs, num_pairs, num_experts, EXPERTS_PAD), axis=0)
    tl.store(chunk_offsets_ptr + chunk * EXPERTS_PAD + tl.arange(0, EXPERTS_PAD), counts)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "max_num_padded"])
def moe_align_scan_kernel(
    chunk_offsets_ptr, expert_starts_ptr, sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    num_pairs, num_chunks, max_num_padded,
    BLOCK_M: tl.constexpr, EXPERTS_PAD: tl.constexpr, ROWS: tl.constexpr, FILL: tl.constexpr,
):
    experts = tl.arange(0, EXPERTS_PAD)
    counts = tl.zeros([EXPERTS_PAD], dtype=tl.int32)  # running total over the chunks seen so far
    for start in range(0, num_chunks, ROWS):
        rows = start + tl.arange(0, ROWS)
        ptrs = chunk_offsets_ptr + rows[:, None] * EXPERTS_PAD + experts[None, :]
        block = tl.load(ptrs, mask=rows[:, None] < num_chunks, other=0)  # [ROWS, EXPERTS_PAD]
        tl.store(ptrs, tl.cumsum(block, axis=0) - block + counts[None, :], mask=rows[:, None] < num_chunks)
        counts += tl.sum(block, axis=0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M  # an expert with no pair takes no tile
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    num_post_padded = tl.sum(padded, axis=0)
    tl.store(expert_starts_ptr + experts, padded_start)
    tl.store(num_tokens_post_padded_ptr, num_post_padded)
    # Tile t belongs to the first expert whose padded rows end after t * BLOCK_M (empty experts end
    # where they start, so they own none); tiles past the end get -1.
    for start in range(0, max_num_padded // BLOCK_M, ROWS):
        tiles = start + tl.arange(0, ROWS)
        owner = tl.sum((padded_end[None, :] <= tiles[:, None] * BLOCK_M).to(tl.int32), axis=1)
        owner = tl.where(tiles * BLOCK_M < num_post_padded, owner, -1)
        tl.store(expert_ids_ptr + tiles, owner, mask=tiles < max_num_padded // BLOCK_M)
    # Sentinels: each expert's padding rows (< BLOCK_M of them), then every row past the end.
    pad = tl.arange(0, BLOCK_M)
    pad_rows = (padded_start + counts)[:, None] + pad[None, :]  # [EXPERTS_PAD, BLOCK_M]
    tl.store(sorted_token_ids_ptr + pad_rows, tl.full(pad_rows.shape, num_pairs, tl.int32),
             mask=pad[None, :] < (padded - counts)[:, None])
    for start in range(num_post_padded, max_num_padded, FILL):
        offs = start + tl.arange(0, FILL)
        tl.store(sorted_token_ids_ptr + offs, tl.full([FILL], num_pairs, tl.int32), mask=offs < max_num_padded)


@triton.jit(do_not_specialize=["num_pairs", "chunk_size"])
def moe_align_place_kernel(topk_ids_ptr, chunk_offsets_ptr, expert_starts_ptr, sorted_token_ids_ptr,
                           num_pairs, num_experts, chunk_size, SUB: tl.constexpr, EXPERTS_PAD: tl.constexpr):
    chunk = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_PAD)
    # next free row of each expert for this chunk's pairs
    next_row = tl.load(expert_starts_ptr + experts) + tl.load(chunk_offsets_ptr + chunk * EXPERTS_PAD + experts)
    for start in range(0, chunk_size, SUB):
        offs = chunk * chunk_size + start + tl.arange(0, SUB)
        one_hot = _one_hot_experts(topk_ids_ptr, offs, num_pairs, num_experts, EXPERTS_PAD)  # [SUB, EXPERTS_PAD]
        earlier = tl.cumsum(one_hot, axis=0) - one_hot  # same-expert pairs before this one in the piece
        rows = tl.sum(one_hot * (next_row[None, :] + earlier), axis=1)  # [SUB]
        tl.store(sorted_token_ids_ptr + rows, offs.to(tl.int32), mask=tl.sum(one_hot, axis=1) > 0)
        next_row += tl.sum(one_hot, axis=0)


def moe_align_block_size(topk_ids, num_experts, block_m):
    """Triton version of `moe_align_block_size_ref`: topk_ids [M, topk] int32/int64 -> MoEAlignment.

    Never syncs with the host (buffers sized by `moe_padded_size`), so it can be captured in a CUDA
    graph. Ids must lie in [0, num_experts): checking would sync; a pair outside is left out.
    """
    _check_align_arguments(topk_ids, num_experts, block_m)
    assert topk_ids.is_contiguous(), "topk_ids must be contiguous (pair p = token * topk + slot)"
    num_pairs = topk_ids.numel()
    max_num_padded = moe_padded_size(num_pairs, num_experts, block_m)
    device = topk_ids.device
    sorted_token_ids = torch.empty(max_num_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_num_padded // block_m, dtype=torch.int32, device=device)
    num_tokens_post_padded = torch.empty(1, dtype=torch.int32, device=device)
    alignment = MoEAlignment(sorted_token_ids, expert_ids, num_tokens_post_padded)
    if num_pairs == 0:
        num_tokens_post_padded.zero_()
        return alignment
    assert block_m & (block_m - 1) == 0, f"block_m must be a power of two, got {block_m}"
    experts_pad = triton.next_power_of_2(num_experts)
    chunk_size = ALIGN_SUB * triton.cdiv(triton.cdiv(num_pairs, ALIGN_SUB), ALIGN_MAX_CHUNKS)
    num_chunks = triton.cdiv(num_pairs, chunk_size)
    chunk_offsets = torch.empty(num_chunks, experts_pad, dtype=torch.int32, device=device)
    expert_starts = torch.empty(experts_pad, dtype=torch.int32, device=device)
    common = dict(SUB=ALIGN_SUB, EXPERTS_PAD=experts_pad)
    moe_align_count_kernel[(num_chunks,)](topk_ids, chunk_offsets, num_pairs, num_experts, chunk_size, **common)
    moe_align_scan_kernel[(1,)](
        chunk_offsets, expert_starts, sorted_token_ids, expert_ids, num_tokens_post_padded,
        num_pairs, num_chunks, max_num_padded,
        BLOCK_M=block_m, EXPERTS_PAD=experts_pad, ROWS=16, FILL=1024, num_warps=4)
    moe_align_place_kernel[(num_chunks,)](topk_ids, chunk_offsets, expert_starts, sorted_token_ids,
                                          num_pairs, num_experts, chunk_size, **common)
    return alignment


# ----------------------------------------------------------------------------- grouped GEMMs
#
# One program per [BLOCK_M, BLOCK_N] output tile of one expert's BLOCK_M sorted rows. The grid is
# sized for the worst case (max_num_padded rows); a program whose tile starts past
# num_tokens_post_padded returns before reading anything.
#
#   kernel 1:  act[p, n]  = silu(x[p // topk] . w13[e, n]) * (x[p // topk] . w13[e, N + n])   [M*topk, N]
#   kernel 2:  out[p, k]  = topk_weights[p] * (act[p] . w2[e, k])                             [M*topk, K]
#   then       y[m]       = sum_j out[m * topk + j]                                           [M, K]
#
# Padding rows (sentinel M*topk) read row 0 (always in bounds) and are never stored. Columns past the
# edge wrap around (in bounds) and are not stored either. act is computed in float32 and stored in
# the input dtype between the two GEMMs; out is stored in the input dtype and summed in float32.


@dataclass(frozen=True)
class MoEConfig:
    BLOCK_M: int  # sorted rows per tile (the align step pads each expert to a multiple of it)
    BLOCK_N: int  # output columns per tile (kernel 1: of N, for gate and up each; kernel 2: of K)
    BLOCK_K: int  # reduction step (kernel 1: over K; kernel 2: over N)
    GROUP_M: int  # tile rows per group of programs that share weight tiles in L2 (matmul tutorial)
    num_warps: int
    num_stages: int

    def __post_init__(self):
        for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
            value = getattr(self, name)
            assert value >= 16 and value & (value - 1) == 0, f"{name} must be a power of two >= 16, got {value}"
        assert self.GROUP_M >= 1, f"GROUP_M must be >= 1, got {self.GROUP_M}"
        assert self.num_warps in (1, 2, 4, 8, 16), f"num_warps must be a power of two <= 16, got {self.num_warps}"
        assert self.num_stages >= 1, f"num_stages must be >= 1, got {self.num_stages}"


def moe_config(M, E, N, K, topk, dtype):
    """The path and its tiles: up to SMALL_MAX_PAIRS (token, slot) pairs the few-pairs path
    (SmallMoEConfig), above it the aligned grouped GEMMs with tiles by the rows each expert gets on
    average (M * topk / E). The values won `benchmarks/tune_kernels.py --only moe` on an H100
    (kernels/TUNING.md, 2026-12-07). Few rows per expert (decode) is a weight read: 16-row
    tiles waste the least padding; many rows (prefill) is compute-bound: 64- and 128-row tiles feed
    the tensor cores."""
    if M * topk <= SMALL_MAX_PAIRS:
        return SmallMoEConfig(BLOCK_N=32, BLOCK_K=64) if is_interpreter() else SMALL_CONFIG
    if is_interpreter():  # numpy: fewer, smaller programs
        return MoEConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=1)
    rows_per_expert = M * topk / E
    if rows_per_expert <= 8:
        config = MoEConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
    elif rows_per_expert <= 32:
        config = MoEConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)
    elif rows_per_expert <= 128:
        config = MoEConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)
    elif rows_per_expert <= 512:  # (M = 4,096 at top-8 of 128: 1.13x the 128 x 128 tile; at 16,384 it loses)
        config = MoEConfig(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    else:
        config = MoEConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    if dtype == torch.float32:  # twice the bytes per tile: halve the K step to fit shared memory
        config = MoEConfig(config.BLOCK_M, config.BLOCK_N, max(16, config.BLOCK_K // 2), config.GROUP_M,
                           config.num_warps, config.num_stages)
    return config


@triton.jit
def _tile_of_program(num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program: GROUP_M tile rows at a time, all their column tiles."""
    pid = tl.program_id(0)
    num_pid_m = tl.num_programs(0) // num_pid_n
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _tile_rows(sorted_token_ids_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr):
    """The tile's pair ids [BLOCK_M] (int64) and which of them are real (not the sentinel)."""
    pair_ids = tl.load(sorted_token_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return pair_ids, pair_ids < num_pairs


@triton.jit(do_not_specialize=["num_pairs"])
def fused_moe_gate_up_kernel(
    x_ptr, w13_ptr, act_ptr, sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    num_pairs, N, K, stride_xm, stride_we, stride_wn, stride_wk, stride_am,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_of_program(tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    pair_ids, row_ok = _tile_rows(sorted_token_ids_ptr, pid_m, num_pairs, BLOCK_M)
    tokens = tl.where(row_ok, pair_ids // TOP_K, 0)  # padding rows read token 0
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    gate_ptrs = w13_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    up_ptrs = gate_ptrs + N * stride_wn  # [BLOCK_K, BLOCK_N], the up rows N apart from the gate rows

    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
        acc_gate = tl.dot(x, tl.load(gate_ptrs, mask=k_ok[:, None], other=0.0), acc_gate)
        acc_up = tl.dot(x, tl.load(up_ptrs, mask=k_ok[:, None], other=0.0), acc_up)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K * stride_wk
        up_ptrs += BLOCK_K * stride_wk

    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up  # silu(gate) * up in float32
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(act_ptr + pair_ids[:, None] * stride_am + cols[None, :], act.to(act_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (cols[None, :] < N))


@triton.jit(do_not_specialize=["num_pairs"])
def fused_moe_down_kernel(
    act_ptr, w2_ptr, out_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr,
    num_tokens_post_padded_ptr, num_pairs, N, K, stride_am, stride_we, stride_wk, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """The output columns are the hidden size K; the reduction runs over the intermediate size N."""
    pid_m, pid_n = _tile_of_program(tl.cdiv(K, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    pair_ids, row_ok = _tile_rows(sorted_token_ids_ptr, pid_m, num_pairs, BLOCK_M)
    rows = tl.where(row_ok, pair_ids, 0)  # padding rows read pair 0
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_out = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % K
    offs_red = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None] * stride_am + offs_red[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w2_ptr + expert * stride_we + offs_out[None, :] * stride_wk + offs_red[:, None] * stride_wn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(N, BLOCK_K)):
        k_ok = offs_red < N - k * BLOCK_K
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.load(w_ptrs, mask=k_ok[:, None], other=0.0), acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wn

    acc = acc * tl.load(topk_weights_ptr + rows)[:, None]  # the routing weight, in float32
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + pair_ids[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (cols[None, :] < K))


# ----------------------------------------------------------------------------- few pairs (decode)
#
# With a few (token, slot) pairs the align step and the separate sum over top-k cost more than the
# tiles save: at M = 1 on the H200 they were a third of the call (benchmarks/README.md, 2026-12-04).
# So for few pairs, no sorting: each pair reads its own expert's rows, and each token's program sums
# its top-k in registers.
#
#   kernel 1 (pairs):  grid (pairs, N / BLOCK_N)    act[p, n] = silu(x[p // topk] . w13[e_p, n]) * (x[p // topk] . w13[e_p, N + n])
#   kernel 2 (tokens): grid (tokens, K / BLOCK_N)   y[m, k] = sum_j w_mj * (act[m * topk + j] . w2[e_mj, k])
#
# Multiply-adds (tl.sum), not tl.dot. Without tl.dot the compiler does not pipeline the loads, so
# each reduction step is a memory round trip (kernels/gemv.py, gemv_config). `sum_once` is the GEMV's
# answer, to be timed: fewer, longer steps, the cross-thread sum once after the loop, the down kernel's
# TOP_K experts loaded together in each step. Two pairs of one expert read its rows twice (the second
# read mostly from L2); with few pairs over many experts that is rare. A pair whose
# expert id lies outside [0, E) reads nothing and adds nothing, as in the aligned path. The sum over
# the top k is float32, rounded once.


@dataclass(frozen=True)
class SmallMoEConfig:
    """Tiles of the few-pairs path: BLOCK_N output columns per program, BLOCK_K of the reduction per step.
    sum_once: keep the products [BLOCK_N, BLOCK_K] in float32 and sum them once after the loop (the down
    kernel then takes the experts inside each step), instead of a sum per step; the GEMV's form
    (kernels/gemv.py), behind the tuner until a GPU run times it."""
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int = 4
    sum_once: bool = False

    def __post_init__(self):
        for name in ("BLOCK_N", "BLOCK_K"):
            value = getattr(self, name)
            assert value >= 1 and value & (value - 1) == 0, f"{name} must be a power of two, got {value}"


# Up to this many (token, slot) pairs `moe_config` takes the few-pairs path (Qwen3-30B-A3B's top-8:
# M <= 4). The tuner on an H100 (kernels/TUNING.md, 2026-12-07): at M = 4 this path with 8-column
# tiles beat every aligned tile by 9%; at M = 1 the best aligned tile beat it by 8%, at M = 16 by 13%.
SMALL_MAX_PAIRS = 32
SMALL_CONFIG = SmallMoEConfig(BLOCK_N=8, BLOCK_K=256)


@triton.jit
def _expert_of_pair(topk_ids_ptr, pair, num_experts):
    """(expert id as int64, clamped into range, and whether the id was in range)."""
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    valid = (expert >= 0) & (expert < num_experts)
    return tl.where(valid, expert, 0), valid


@triton.jit
def fused_moe_small_gate_up_kernel(
    x_ptr, w13_ptr, act_ptr, topk_ids_ptr, N, K, num_experts, stride_xm, stride_we, stride_wn, stride_am,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUM_ONCE: tl.constexpr,
):
    pair = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert, valid = _expert_of_pair(topk_ids_ptr, pair, num_experts)
    n_ok = offs_n < tl.where(valid, N, 0)  # an id out of range reads no row
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xm
    gate_rows = w13_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    up_rows = gate_rows + N * stride_wn
    if SUM_ONCE:  # the products, summed over K after the loop
        gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:  # a sum per K step
        gate = tl.zeros([BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_row + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        mask = n_ok[:, None] & k_ok[None, :]
        if SUM_ONCE:
            gate += tl.load(gate_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32) * x
            up += tl.load(up_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32) * x
        else:
            gate += tl.sum(tl.load(gate_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32) * x, axis=1)
            up += tl.sum(tl.load(up_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32) * x, axis=1)
    if SUM_ONCE:
        gate = tl.sum(gate, axis=1)
        up = tl.sum(up, axis=1)
    act = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up in float32
    tl.store(act_ptr + pair * stride_am + offs_n, act.to(act_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _down_rows(act_ptr, w2_ptr, topk_ids_ptr, pair, offs_out, K, num_experts, stride_am, stride_we, stride_wk):
    """A pair's activation row, its expert's down rows [BLOCK_N, 1] and the column limit (0 for an id out of
    range: it reads no row)."""
    expert, valid = _expert_of_pair(topk_ids_ptr, pair, num_experts)
    a_row = act_ptr + pair.to(tl.int64) * stride_am
    w_rows = w2_ptr + expert * stride_we + offs_out[:, None].to(tl.int64) * stride_wk
    return a_row, w_rows, tl.where(valid, K, 0)


@triton.jit
def _down_step(a_row, w_rows, k_limit, offs_out, offs_r, r_ok):
    """The activation slice [BLOCK_K] and the weight tile [BLOCK_N, BLOCK_K] of one N step, in float32."""
    a = tl.load(a_row + offs_r, mask=r_ok, other=0.0).to(tl.float32)
    w = tl.load(w_rows + offs_r[None, :], mask=(offs_out < k_limit)[:, None] & r_ok[None, :], other=0.0)
    return a, w.to(tl.float32)


@triton.jit
def fused_moe_small_down_kernel(
    act_ptr, w2_ptr, out_ptr, topk_weights_ptr, topk_ids_ptr, N, K, num_experts, stride_am, stride_we,
    stride_wk, stride_om, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SUM_ONCE: tl.constexpr,
):
    """The output columns are the hidden size K; the reduction runs over the intermediate size N and the
    token's TOP_K experts."""
    token = tl.program_id(0)
    offs_out = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ok = offs_out < K
    if SUM_ONCE:  # experts inside each N step: all TOP_K experts' loads issued before any wait
        products = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_K):
            offs_r = n0 + tl.arange(0, BLOCK_K)
            r_ok = offs_r < N
            for j in tl.static_range(TOP_K):
                pair = token * TOP_K + j
                a_row, w_rows, k_limit = _down_rows(act_ptr, w2_ptr, topk_ids_ptr, pair, offs_out, K, num_experts,
                                                    stride_am, stride_we, stride_wk)
                a, w = _down_step(a_row, w_rows, k_limit, offs_out, offs_r, r_ok)
                products += w * (a * tl.load(topk_weights_ptr + pair))[None, :]  # the routing weight, float32
        acc = tl.sum(products, axis=1)
    else:  # an expert at a time, a sum per N step
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(TOP_K):  # unrolled: the experts' loads need not wait for each other's sums
            pair = token * TOP_K + j
            a_row, w_rows, k_limit = _down_rows(act_ptr, w2_ptr, topk_ids_ptr, pair, offs_out, K, num_experts,
                                                stride_am, stride_we, stride_wk)
            part = tl.zeros([BLOCK_N], dtype=tl.float32)
            for n0 in range(0, N, BLOCK_K):
                offs_r = n0 + tl.arange(0, BLOCK_K)
                a, w = _down_step(a_row, w_rows, k_limit, offs_out, offs_r, offs_r < N)
                part += tl.sum(w * a[None, :], axis=1)
            acc += tl.load(topk_weights_ptr + pair) * part  # the routing weight, in float32
    tl.store(out_ptr + token.to(tl.int64) * stride_om + offs_out, acc.to(out_ptr.dtype.element_ty), mask=out_ok)


def _fused_moe_small(hidden_states, w13, w2, topk_weights, topk_ids, config: SmallMoEConfig):
    num_tokens, hidden_size = hidden_states.shape
    num_experts, two_n, _ = w13.shape
    n, top_k = two_n // 2, topk_ids.shape[1]
    act = torch.empty(num_tokens * top_k, n, dtype=hidden_states.dtype, device=hidden_states.device)
    out = torch.empty(num_tokens, hidden_size, dtype=hidden_states.dtype, device=hidden_states.device)
    tiles = dict(TOP_K=top_k, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K, SUM_ONCE=config.sum_once,
                 num_warps=config.num_warps)
    fused_moe_small_gate_up_kernel[(num_tokens * top_k, triton.cdiv(n, config.BLOCK_N))](
        hidden_states, w13, act, topk_ids, n, hidden_size, num_experts, hidden_states.stride(0), w13.stride(0),
        w13.stride(1), act.stride(0), **tiles)
    fused_moe_small_down_kernel[(num_tokens, triton.cdiv(hidden_size, config.BLOCK_N))](
        act, w2, out, topk_weights, topk_ids, n, hidden_size, num_experts, act.stride(0), w2.stride(0),
        w2.stride(1), out.stride(0), **tiles)
    return out


def fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, config: MoEConfig | SmallMoEConfig | None = None):
    """Triton version of `fused_moe_ref` (same arguments): align, two grouped GEMMs, sum over top-k;
    or, for a few (token, slot) pairs, the two kernels of the few-pairs path (no align, the sum fused).

    config: the path and its tiles (default `moe_config`; for tuning): a MoEConfig for the aligned
    grouped GEMMs, a SmallMoEConfig for the few-pairs path. Every input contiguous in its last dim;
    topk_weights and topk_ids contiguous. Never syncs with the host, so it can be captured in a
    CUDA graph. Returns a new [M, K] tensor in hidden_states.dtype. Expert ids must lie in [0, E), as
    the router's top-k always makes them (checking would sync): the few-pairs path adds nothing for
    one outside, the aligned path leaves that pair out of every tile and sums an unwritten row.
    """
    _check_moe_arguments(hidden_states, w13, w2, topk_weights, topk_ids)
    for name, t in (("hidden_states", hidden_states), ("w13", w13), ("w2", w2)):
        assert t.stride(-1) == 1, f"{name} must be contiguous in its last dim (strides {t.stride()})"
    assert topk_weights.is_contiguous() and topk_ids.is_contiguous(), "topk_weights and topk_ids must be contiguous"
    num_tokens, hidden_size = hidden_states.shape
    num_experts, two_n, _ = w13.shape
    n, top_k = two_n // 2, topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    dtype, device = hidden_states.dtype, hidden_states.device
    if num_pairs == 0:
        return torch.zeros(num_tokens, hidden_size, dtype=dtype, device=device)
    config = config or moe_config(num_tokens, num_experts, n, hidden_size, top_k, dtype)
    if isinstance(config, SmallMoEConfig):
        return _fused_moe_small(hidden_states, w13, w2, topk_weights, topk_ids, config)
    align = moe_align_block_size(topk_ids, num_experts, config.BLOCK_M)
    num_pid_m = align.sorted_token_ids.shape[0] // config.BLOCK_M  # the worst case; the rest return early
    act = torch.empty(num_pairs, n, dtype=dtype, device=device)  # [M * topk, N]
    pair_out = torch.empty(num_pairs, hidden_size, dtype=dtype, device=device)  # [M * topk, K]
    tiles = dict(BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K, GROUP_M=config.GROUP_M,
                 num_warps=config.num_warps, num_stages=config.num_stages)
    fused_moe_gate_up_kernel[(num_pid_m * triton.cdiv(n, config.BLOCK_N),)](
        hidden_states, w13, act, align.sorted_token_ids, align.expert_ids, align.num_tokens_post_padded,
        num_pairs, n, hidden_size, hidden_states.stride(0), w13.stride(0), w13.stride(1), w13.stride(2),
        act.stride(0), TOP_K=top_k, **tiles)
    fused_moe_down_kernel[(num_pid_m * triton.cdiv(hidden_size, config.BLOCK_N),)](
        act, w2, pair_out, topk_weights, align.sorted_token_ids, align.expert_ids, align.num_tokens_post_padded,
        num_pairs, n, hidden_size, act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), pair_out.stride(0),
        **tiles)
    return pair_out.view(num_tokens, top_k, hidden_size).sum(dim=1)  # float32 accumulation, one rounding
