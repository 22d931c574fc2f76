"""Fused sampling: greedy and temperature sampling of a whole batch in one pass over the logits.

Gumbel-max trick: argmax_v(logits[v] / T + g[v]) with g = -log(-log(u)), u ~ U(0, 1), draws v
from softmax(logits / T) exactly; it is the exponential race argmax(probs / q), q ~ Exp(1), taken
in log space. u comes from Philox (tl.rand4x: four uniforms per call) keyed by a per-row seed, so
no noise tensor is materialized. vLLM: vllm/v1/sample/ops/topk_topp_sampler.py (random_sample), FlashInfer's sampling.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import is_interpreter, num_sms

LOGITS_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def sample_tokens_ref(logits, temperatures, gumbel_noise):
    """Naive reference: one token id per row, given the noise explicitly.

    logits: [batch, vocab] float; temperatures: [batch] float32, 0 = greedy;
    gumbel_noise: [batch, vocab] float32 (e.g. `gumbel_noise(seeds, vocab)`). Ties go to the
    smallest index (torch.argmax). Returns [batch] int64.
    """
    logits = logits.float()
    is_greedy = temperatures == 0
    scaled = logits / torch.where(is_greedy, 1.0, temperatures).unsqueeze(1) + gumbel_noise
    return torch.where(is_greedy, logits.argmax(dim=-1), scaled.argmax(dim=-1))


# ----------------------------------------------------------------------------------------------
# Triton kernels
#
#   row b:  vocab 0 ............................................................ vocab_size
#           | chunk 0                 | chunk 1                 | chunk 2          |
#           | tile | tile | tile | ... | tile | tile | tile | ... | tile | tile ... |
#   Program (b, c) streams chunk c of row b, NOISE_TILE logits per tile. Each lane keeps the best
#   score it has seen and its first index; at the end the lanes agree on the chunk's best score
#   and the smallest index holding it, written to chunk_values[b, c] / chunk_ids[b, c].
#   merge_chunks_kernel then takes per row the smallest index among the chunks holding the max.
#   Score: logits[v] (greedy row, T == 0) or logits[v] / T + g(seed_b, v) (sampled row).
# ----------------------------------------------------------------------------------------------
# Noise layout. One Philox call gives four uniforms (tl.rand4x), so lanes draw them four tokens
# at a time: token v lives in tile v // NOISE_TILE and quarter k = (v % NOISE_TILE) // QUARTER;
# lane j = v % QUARTER of that tile takes output k of Philox(seed, tile * QUARTER + j). Kernels
# therefore walk the vocabulary in whole, aligned NOISE_TILE tiles (chunks start at multiples).
NOISE_TILE = 1024
QUARTER = NOISE_TILE // 4
# tl.rand4x gives u in [0, 1), 0 included: clamp so that -log(-log(u)) is finite (about -3.1 .. 16.6).
UNIFORM_MIN = tl.constexpr(2.0**-32)
UNIFORM_MAX = tl.constexpr(1.0 - 2.0**-24)  # the largest float32 below 1


@triton.jit
def _gumbel(u):
    """Gumbel(0, 1) noise from uniforms u."""
    u = tl.minimum(tl.maximum(u, UNIFORM_MIN), UNIFORM_MAX)
    return -tl.log(-tl.log(u))


@triton.jit
def _tile_noise(seed, tile_start, QUARTER: tl.constexpr):
    """The Gumbel noise of the four quarters of the tile starting at token `tile_start`."""
    u0, u1, u2, u3 = tl.rand4x(seed, tile_start // 4 + tl.arange(0, QUARTER))
    return _gumbel(u0), _gumbel(u1), _gumbel(u2), _gumbel(u3)


@triton.jit
def _keep_best(row_ptr, offs, end, noise, temperature, best_value, best_id, SAMPLE: tl.constexpr):
    score = tl.load(row_ptr + offs, mask=offs < end, other=float("-inf")).to(tl.float32)
    if SAMPLE:
        # div_rn: IEEE division, as torch's `logits / T` (plain `/` may be approximate on GPU).
        score = tl.div_rn(score, temperature) + noise
    better = score > best_value  # strict: a lane keeps its earliest index on ties
    return tl.where(better, score, best_value), tl.where(better, offs, best_id)


@triton.jit
def _chunk_argmax(row_ptr, start, end, seed, temperature, SAMPLE: tl.constexpr, QUARTER: tl.constexpr):
    """(best score, smallest index holding it) over logits[start:end] of one row; start is a
    multiple of 4 * QUARTER (a noise tile)."""
    best_value = tl.full([QUARTER], float("-inf"), dtype=tl.float32)
    best_id = tl.full([QUARTER], 0, dtype=tl.int32) + start  # an all -inf chunk answers `start`
    lanes = tl.arange(0, QUARTER)
    for tile_start in range(start, end, 4 * QUARTER):
        if SAMPLE:
            g0, g1, g2, g3 = _tile_noise(seed, tile_start, QUARTER)
        else:
            g0 = tl.zeros([QUARTER], dtype=tl.float32)  # unused: greedy rows add no noise
            g1, g2, g3 = g0, g0, g0
        # quarters in increasing token order, so the strict comparison keeps the earliest index
        best_value, best_id = _keep_best(row_ptr, tile_start + lanes, end, g0, temperature, best_value, best_id, SAMPLE)
        best_value, best_id = _keep_best(row_ptr, tile_start + QUARTER + lanes, end, g1, temperature, best_value,
                                         best_id, SAMPLE)
        best_value, best_id = _keep_best(row_ptr, tile_start + 2 * QUARTER + lanes, end, g2, temperature, best_value,
                                         best_id, SAMPLE)
        best_value, best_id = _keep_best(row_ptr, tile_start + 3 * QUARTER + lanes, end, g3, temperature, best_value,
                                         best_id, SAMPLE)
    value = tl.max(best_value, 0)
    index = tl.min(tl.where(best_value == value, best_id, end), 0)
    return value, index


@triton.jit(do_not_specialize=["num_chunks"])  # one compiled variant for every batch size
def sample_chunks_kernel(
    logits_ptr, temperatures_ptr, seeds_ptr, chunk_values_ptr, chunk_ids_ptr,
    vocab_size, stride_row, chunk_size, num_chunks,
    QUARTER: tl.constexpr,
):
    """Grid: (batch, num_chunks). Writes this chunk's best score (fp32) and its token id (int64)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temperatures_ptr + row)
    seed = tl.load(seeds_ptr + row)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    start = chunk * chunk_size
    end = tl.minimum(start + chunk_size, vocab_size)
    if temperature == 0.0:  # greedy row: no noise to draw
        value, index = _chunk_argmax(row_ptr, start, end, seed, temperature, SAMPLE=False, QUARTER=QUARTER)
    else:
        value, index = _chunk_argmax(row_ptr, start, end, seed, temperature, SAMPLE=True, QUARTER=QUARTER)
    out = row.to(tl.int64) * num_chunks + chunk
    tl.store(chunk_values_ptr + out, value)
    tl.store(chunk_ids_ptr + out, index.to(tl.int64))


@triton.jit(do_not_specialize=["num_chunks"])
def merge_chunks_kernel(chunk_values_ptr, chunk_ids_ptr, out_ptr, num_chunks, vocab_size,
                        CHUNKS_PAD: tl.constexpr):
    """One program per row: the smallest token id among the chunks holding the row's best score
    (chunks cover increasing ids, so this is the first such chunk, as torch.argmax would pick)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNKS_PAD)
    ok = offs < num_chunks
    values = tl.load(chunk_values_ptr + row * num_chunks + offs, mask=ok, other=float("-inf"))
    ids = tl.load(chunk_ids_ptr + row * num_chunks + offs, mask=ok, other=0)
    best = tl.max(values, 0)
    tl.store(out_ptr + row, tl.min(tl.where(ok & (values == best), ids, vocab_size), 0))


@triton.jit
def gumbel_noise_kernel(seeds_ptr, noise_ptr, vocab_size, QUARTER: tl.constexpr):
    """Grid: (batch, cdiv(vocab, NOISE_TILE)). The noise sample_chunks_kernel adds, made visible."""
    row = tl.program_id(0)
    tile_start = tl.program_id(1) * 4 * QUARTER
    g0, g1, g2, g3 = _tile_noise(tl.load(seeds_ptr + row), tile_start, QUARTER)
    row_ptr = noise_ptr + row.to(tl.int64) * vocab_size
    offs = tile_start + tl.arange(0, QUARTER)
    tl.store(row_ptr + offs, g0, mask=offs < vocab_size)
    tl.store(row_ptr + QUARTER + offs, g1, mask=QUARTER + offs < vocab_size)
    tl.store(row_ptr + 2 * QUARTER + offs, g2, mask=2 * QUARTER + offs < vocab_size)
    tl.store(row_ptr + 3 * QUARTER + offs, g3, mask=3 * QUARTER + offs < vocab_size)


# ----------------------------------------------------------------------------------------------
# Host wrappers
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SamplingConfig:
    num_warps: int
    programs_per_sm: int  # split the vocabulary until batch * chunks reaches this many per SM
    max_chunks: int  # never split a row into more chunks than this


def sampling_config(device):
    """Fixed heuristics; nothing here reads tensor contents."""
    if device.type != "cuda" or is_interpreter():
        # The interpreter's cost is per tile, whatever its size: big tiles, few chunks.
        return SamplingConfig(num_warps=4, programs_per_sm=2, max_chunks=8)
    # Not tuned yet: 1024-logit tiles (16-byte bf16 loads with 4 warps); ~4 programs per SM so
    # batch 1 (up to 64 chunks) and batch 256 (3 chunks of a 151936 vocabulary) both fill an H200.
    return SamplingConfig(num_warps=4, programs_per_sm=4, max_chunks=64)


def sampling_num_chunks(batch, vocab_size, device, config):
    """Vocabulary chunks per row from shapes only (CUDA-graph safe)."""
    sm_count = num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    wanted = triton.cdiv(config.programs_per_sm * sm_count, max(batch, 1))
    return max(1, min(wanted, config.max_chunks, triton.cdiv(vocab_size, NOISE_TILE)))


def _check_arguments(logits, temperatures, seeds):
    assert logits.dim() == 2, f"logits must be [batch, vocab], got shape {tuple(logits.shape)}"
    batch, vocab_size = logits.shape
    assert logits.dtype in LOGITS_DTYPES, f"logits dtype {logits.dtype} not in {LOGITS_DTYPES}"
    assert logits.stride(1) == 1 or vocab_size == 1, f"logits must be contiguous in vocab (strides {logits.stride()})"
    assert temperatures.shape == (batch,) and temperatures.dtype == torch.float32, (
        f"temperatures must be float32 [batch={batch}], got {temperatures.dtype} {tuple(temperatures.shape)}")
    assert seeds.shape == (batch,) and seeds.dtype == torch.int64, (
        f"seeds must be int64 [batch={batch}], got {seeds.dtype} {tuple(seeds.shape)}")
    assert logits.device == temperatures.device == seeds.device, (
        f"logits, temperatures and seeds are on {logits.device}, {temperatures.device}, {seeds.device}")
    assert logits.is_cuda or is_interpreter(), "sample_tokens needs CUDA tensors (or TRITON_INTERPRET=1)"
    assert batch == 0 or 0 < vocab_size < 2**31, f"vocab size {vocab_size} must be in [1, 2**31)"


def sample_tokens(logits, temperatures, seeds, num_chunks=0):
    """One token id per row: argmax(logits) where temperature == 0, else a draw from
    softmax(logits / T) by Gumbel-max with Philox noise keyed by (seeds[row], token id).

    Args:
        logits: [batch, vocab] float16/bfloat16/float32, contiguous in vocab (any row stride);
            -inf entries are never drawn unless the whole row is -inf (then the answer is 0);
            NaN entries are never drawn either (torch.argmax would pick them).
        temperatures: [batch] float32; 0 = greedy (ties -> smallest id, as torch.argmax).
        seeds: [batch] int64 Philox seed of each row for this step (same seed, same draw).
        num_chunks: vocabulary chunks per row; 0 picks them from shapes.
    Returns:
        [batch] int64 token ids, on the logits' device. Never syncs with the host.
    """
    _check_arguments(logits, temperatures, seeds)
    batch, vocab_size = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    config = sampling_config(logits.device)
    if num_chunks == 0:
        num_chunks = sampling_num_chunks(batch, vocab_size, logits.device, config)
    assert num_chunks >= 1, f"num_chunks must be >= 1, got {num_chunks}"
    chunk_size = triton.cdiv(triton.cdiv(vocab_size, num_chunks), NOISE_TILE) * NOISE_TILE  # whole noise tiles
    num_chunks = triton.cdiv(vocab_size, chunk_size)  # no empty trailing chunks
    chunk_values = torch.empty((batch, num_chunks), dtype=torch.float32, device=logits.device)
    chunk_ids = out.view(batch, 1) if num_chunks == 1 else torch.empty_like(chunk_values, dtype=torch.int64)
    sample_chunks_kernel[(batch, num_chunks)](
        logits, temperatures.contiguous(), seeds.contiguous(), chunk_values, chunk_ids,
        vocab_size, logits.stride(0), chunk_size, num_chunks,
        QUARTER=QUARTER, num_warps=config.num_warps,
    )
    if num_chunks > 1:
        merge_chunks_kernel[(batch,)](
            chunk_values, chunk_ids, out, num_chunks, vocab_size,
            # padded to the largest chunk count, not this call's: one compiled variant, not one per
            # batch size (a compile inside a request costs far more than a few masked lanes)
            CHUNKS_PAD=max(2, triton.next_power_of_2(max(num_chunks, config.max_chunks))),
        )
    return out


def gumbel_noise(seeds, vocab_size):
    """[batch, vocab_size] float32: exactly the noise `sample_tokens` adds for these seeds."""
    assert seeds.dim() == 1 and seeds.dtype == torch.int64, f"seeds must be int64 [batch], got {seeds.dtype}"
    assert seeds.is_cuda or is_interpreter(), "gumbel_noise needs CUDA tensors (or TRITON_INTERPRET=1)"
    noise = torch.empty((seeds.shape[0], vocab_size), dtype=torch.float32, device=seeds.device)
    if noise.numel() == 0:
        return noise
    gumbel_noise_kernel[(seeds.shape[0], triton.cdiv(vocab_size, NOISE_TILE))](
        seeds.contiguous(), noise, vocab_size, QUARTER=QUARTER)
    return noise
