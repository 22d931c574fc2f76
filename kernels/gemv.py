"""Small-batch GEMV: y = prologue(x) W^T (+ b) for the few rows of a decode step at small batch, in one
kernel that reads each weight once and folds the op before the GEMM into its prologue.

    prologue "none"           y = x W^T
             "rms_norm"       y = rms_norm(x, g) W^T
             "add_rms_norm"   s = x + residual;  y = rms_norm(s, g) W^T;  s is returned too (the
                              residual stream the next layer reads)
             "silu_and_mul"   y = (silu(gate) * up) W^T   over x = [gate | up]

Why: at batch 1 a decode step of Qwen3-0.6B reads ~1.2 GB of weights, about 0.3 ms at the card's copy
bandwidth, yet each layer launches about nine kernels whose fixed cost (a few microseconds each, even
replayed from a CUDA graph) adds up to more than the reads. Folding RMSNorm (with the residual add)
into the QKV and gate/up GEMVs and SiLU-and-mul into the down GEMV removes three of them per layer,
and splitting K across programs gives a 1024-wide output (o_proj, down_proj) enough programs to keep
every SM reading.

The rounding is the unfused layers': the residual sum, the normalised row and its product with g are
each rounded to the input's dtype, SiLU-and-mul is computed in float32 and rounded once, the GEMV
accumulates in float32 and rounds its output once (to `out_dtype`).
vLLM: its small-batch paths are cuBLAS GEMVs behind fused_add_rms_norm and silu_and_mul kernels
(csrc/layernorm_kernels.cu, csrc/activation_kernels.cu); fusing the norm into the GEMM's prologue is
what its torch.compile fusion passes and FlashInfer's fused kernels aim at.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import MAX_COUNTERS, is_interpreter, num_sms, zeroed_counters

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PROLOGUES = ("none", "rms_norm", "add_rms_norm", "silu_and_mul")
MAX_TILES = MAX_COUNTERS  # output tiles a split-K call may have (the counters are allocated once per device)


def gemv_ref(x, weight, bias=None, *, prologue="none", norm_weight=None, residual=None, eps=1e-6,
             out_dtype=None):
    """Naive reference: the unfused ops, as the model's layers compute them. x [M, K] ([M, 2K] for
    silu_and_mul), weight [N, K] -> y [M, N] in out_dtype (default x's dtype); add_rms_norm returns
    (y, x + residual)."""
    dtype = x.dtype
    summed = None
    if prologue == "add_rms_norm":
        x = summed = x + residual
    if prologue in ("rms_norm", "add_rms_norm"):
        x32 = x.float()
        x = norm_weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    elif prologue == "silu_and_mul":
        gate, up = x.float().chunk(2, dim=-1)
        x = (F.silu(gate) * up).to(dtype)
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    y = y.to(out_dtype or dtype)
    return y if summed is None else (y, summed)


# ----------------------------------------------------------------------------------------------
# Grid: (output tiles, splits). Program (n, s) owns output columns [n * BLOCK_N, (n + 1) * BLOCK_N)
# of all M rows (M <= BLOCK_M) and reads K range s of the weight:
#
#     W [N, K]:   rows of tile n   | split 0 | split 1 | ... | split S-1 |     each weight read once
#     x [M, K]:   all rows          | split 0 | split 1 | ...                  (a few KB, from L2)
#
# A norm prologue needs the whole row's 1 / rms first: every program computes it from the full row
# of x (+ residual). With splits, each writes its float32 partial [M, BLOCK_N] to a workspace and
# counts itself done on the tile's counter; the one that counts last sums the partials in split
# order (the same bits whichever finishes last), adds the bias, stores y and resets the counter, so
# the next call (or a CUDA-graph replay) finds it at zero.
# ----------------------------------------------------------------------------------------------

# The prologue codes: constexpr globals, which a compiled kernel may read (plain ints it may not)
NONE, RMS_NORM, ADD_RMS_NORM, SILU_AND_MUL = (tl.constexpr(i) for i in range(4))


@triton.jit
def _row_rstd(x_ptr, res_ptr, rows, row_mask, K, stride_x, stride_res, eps,
              ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / sqrt(mean(s^2) + eps) per row, s = x (+ residual) rounded to x's dtype: [BLOCK_M]."""
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (offs_k[None, :] < K)
        s = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=mask, other=0.0)
        if ADD:
            r = tl.load(res_ptr + rows[:, None] * stride_res + offs_k[None, :], mask=mask, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(s.dtype)
        s = s.to(tl.float32)
        total += tl.sum(s * s, axis=1)
    return 1.0 / tl.sqrt(total / K + eps)


@triton.jit(do_not_specialize=["M", "eps"])
def gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, res_ptr, res_out_ptr, norm_w_ptr, partial_ptr, counter_ptr,
    M, N, K, k_per_split, stride_x, stride_res, stride_sum, stride_w, stride_out, eps,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    rows = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = offs_n.to(tl.int64) * stride_w  # 64-bit: an LM head's N * K passes 2**31 on large models
    dtype = w_ptr.dtype.element_ty

    if PROLOGUE == RMS_NORM or PROLOGUE == ADD_RMS_NORM:
        rstd = _row_rstd(x_ptr, res_ptr, rows, m_mask, K, stride_x, stride_res, eps,
                         PROLOGUE == ADD_RMS_NORM, BLOCK_M, BLOCK_K)

    if DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:  # the products, summed over K once after the loop: no reduction across threads per tile
        products = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x_mask = m_mask[:, None] & k_mask[None, :]
        x_offs = rows[:, None] * stride_x + offs_k[None, :]
        if PROLOGUE == SILU_AND_MUL:  # x = [gate | up], K columns apart
            gate = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + x_offs + K, mask=x_mask, other=0.0).to(tl.float32)
            a = (gate / (1.0 + tl.exp(-gate)) * up).to(dtype)
        else:
            a = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0)
            if PROLOGUE == ADD_RMS_NORM:
                r = tl.load(res_ptr + rows[:, None] * stride_res + offs_k[None, :], mask=x_mask, other=0.0)
                a = (a.to(tl.float32) + r.to(tl.float32)).to(dtype)
                if pid_n == 0:  # the first tile's programs write the residual stream, a split each
                    tl.store(res_out_ptr + rows[:, None] * stride_sum + offs_k[None, :], a, mask=x_mask)
            if PROLOGUE == RMS_NORM or PROLOGUE == ADD_RMS_NORM:
                g = tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
                a = ((a.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32) * g[None, :]).to(dtype)
        w = tl.load(w_ptr + w_rows[:, None] + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT and dtype == tl.float32:  # full float32 products, not tf32's (the model's own rounding)
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
        elif DOT:
            acc += tl.dot(a.to(dtype), tl.trans(w))
        else:  # M <= a few rows: multiply-adds
            products += a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    if not DOT:
        acc = tl.sum(products, axis=2)

    out_mask = m_mask[:, None] & n_mask[None, :]
    out_offs = rows[:, None] * stride_out + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part_offs = rows[:, None] * N + offs_n[None, :]  # partials: [SPLIT_K, M, N] float32
        tl.store(partial_ptr + pid_k * M * N + part_offs, acc, mask=out_mask)
        done = tl.atomic_add(counter_ptr + pid_n, 1)  # acq_rel: the partial is visible before the count
        if done == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # in split order, whichever split came last
                total += tl.load(partial_ptr + s * M * N + part_offs, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")  # from L2: other SMs wrote them
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + out_offs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.store(counter_ptr + pid_n, 0)


@dataclass(frozen=True)
class GemvConfig:
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int
    DOT: bool
    num_warps: int = 4


def gemv_config(m, n, k, dtype, device) -> GemvConfig:
    """Tiles for an [m, k] x [k, n] GEMV: tensor cores (tl.dot, 16-row tiles) from 4 rows of a half dtype
    on, multiply-adds below; enough output tiles x splits for two programs per SM.

    Multiply-adds take K tiles as long as their products fit (BLOCK_M x 4 x BLOCK_K <= 4096 floats, 32 a
    thread; up to 1024 columns: a whole hidden row of a small model). Their loads are not pipelined by the
    compiler (only a dot's operands are, through shared memory), so a program waits one memory round
    trip per K tile: at batch 1, a row of 1024 weights a thread-block load is one wait, not eight.
    """
    if is_interpreter():  # the CPU, where each program costs milliseconds: few, large tiles
        return GemvConfig(min(64, triton.next_power_of_2(n)), min(256, triton.next_power_of_2(k)), 1, False)
    dot = dtype != torch.float32 and m >= 4
    if dot:
        block_n, block_k = 16, 128
    else:
        block_n = 4
        block_k = max(64, min(1024, triton.next_power_of_2(k), 4096 // (block_n * triton.next_power_of_2(m))))
    tiles = triton.cdiv(n, block_n)
    sms = num_sms(device.index or 0) if device.type == "cuda" else 4
    split = 1
    min_tiles_per_split = 4 if dot else 1
    while tiles * split < 2 * sms and k // (2 * split) >= min_tiles_per_split * block_k and split < 8:
        split *= 2
    return GemvConfig(block_n, block_k, split, dot)


def _tile_counters(device) -> torch.Tensor:
    """The split-K counters of `device`: zeroed once, each reset by the program that uses it last."""
    return zeroed_counters(device, "split-K GEMV")


def _check_arguments(x, weight, bias, prologue, norm_weight, residual):
    """(M, N, K) of a valid call; a ValueError naming the first wrong argument otherwise."""
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue must be one of {PROLOGUES}, got {prologue!r}")
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x and weight must be 2-D, got shapes {tuple(x.shape)} and {tuple(weight.shape)}")
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    width = 2 * k if prologue == "silu_and_mul" else k
    if x.shape[1] != width:
        raise ValueError(f"x has {x.shape[1]} columns; weight {tuple(weight.shape)} with prologue {prologue!r} "
                         f"needs {width}")
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one of {SUPPORTED_DTYPES}, got {x.dtype} and {weight.dtype}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or weight.stride(0) != k:
        raise ValueError("x's rows and weight must be contiguous in their last dim (weight fully contiguous)")
    needs = {"rms_norm": ("norm_weight",), "add_rms_norm": ("norm_weight", "residual")}.get(prologue, ())
    given = dict(norm_weight=norm_weight, residual=residual)
    for name, value in given.items():
        if (value is not None) != (name in needs):
            raise ValueError(f"prologue {prologue!r} {'needs' if name in needs else 'takes no'} {name}")
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"norm_weight must be [{k}], got {tuple(norm_weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual must be x's shape {tuple(x.shape)}, contiguous rows; got {tuple(residual.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    return m, n, k


def gemv(x, weight, bias=None, *, prologue="none", norm_weight=None, residual=None, eps=1e-6, out_dtype=None,
         config: GemvConfig | None = None):
    """Triton version of `gemv_ref`. x [M, K] ([M, 2K] for silu_and_mul) with contiguous rows (they
    may be strided), weight [N, K] contiguous, bias [N], norm_weight [K], residual [M, K] ->
    y [M, N] (and x + residual for add_rms_norm). Meant for M <= 16; any M is computed.

    Never syncs with the host, so it can be captured in a CUDA graph (the split-K workspace is
    allocated in the graph's pool; its counters once per device, before any capture).
    """
    m, n, k = _check_arguments(x, weight, bias, prologue, norm_weight, residual)
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    summed = torch.empty(m, k, dtype=x.dtype, device=x.device) if prologue == "add_rms_norm" else None
    if m == 0 or n == 0:
        return out if summed is None else (out, summed)
    config = config or gemv_config(m, n, k, x.dtype, x.device)
    block_m = max(triton.next_power_of_2(m), 16 if config.DOT else 1)
    tiles = triton.cdiv(n, config.BLOCK_N)
    k_per_split = triton.cdiv(triton.cdiv(k, config.SPLIT_K), config.BLOCK_K) * config.BLOCK_K
    if config.SPLIT_K > 1:
        if tiles > MAX_TILES:
            raise ValueError(f"{tiles} output tiles with split-K; at most {MAX_TILES}")
        partial = torch.empty(config.SPLIT_K, m, n, dtype=torch.float32, device=x.device)  # [SPLIT_K, M, N]
        counters = _tile_counters(x.device)
    else:
        partial = counters = out  # unused
    dummy = x
    gemv_kernel[(tiles, config.SPLIT_K)](
        x, weight, dummy if bias is None else bias, out, dummy if residual is None else residual,
        dummy if summed is None else summed, dummy if norm_weight is None else norm_weight, partial, counters,
        m, n, k, k_per_split, x.stride(0), 0 if residual is None else residual.stride(0),
        0 if summed is None else summed.stride(0), weight.stride(0), out.stride(0), float(eps),
        PROLOGUE=PROLOGUES.index(prologue), HAS_BIAS=bias is not None, SPLIT_K=config.SPLIT_K, DOT=config.DOT,
        BLOCK_M=block_m, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K, num_warps=config.num_warps,
    )
    return out if summed is None else (out, summed)
