"""sample_tokens (Triton, Gumbel-max) against sample_tokens_ref fed the kernel's own noise: exact ids,
greedy ties, banned and NaN tokens, what each chunk reports, the sampled distribution, seeds, argument
checks. They grade exercise 09.1 (sample_chunks_kernel and _gumbel); the known wrong answers at the end
must fail them (the grader can fail).

Under the interpreter a tile with noise costs ~20 ms whatever its size: CPU shapes stay small.
"""
import math

import pytest
import torch
import triton
import triton.language as tl

from conftest_kernels import DEVICE, needs_cuda  # noqa: I001 (sets TRITON_INTERPRET first)
from minivllm.kernels import gumbel_noise, sample_tokens, sample_tokens_ref
from minivllm.kernels import sampling
from minivllm.kernels.sampling import NOISE_TILE, QUARTER, UNIFORM_MAX, UNIFORM_MIN
from wrong_answers import KernelWithOnePieceBroken, builds_on_the_engine, case_id, rejected

# Chi-square critical value at p = 0.001 for 7 degrees of freedom (8 tokens); the seeds are fixed.
CHI2_CRITICAL_0_001_DOF7 = 24.32
EULER_GAMMA = 0.5772156649


def check_against_reference(logits, temperatures, seeds, num_chunks=0):
    tokens = sample_tokens(logits, temperatures, seeds, num_chunks=num_chunks)
    expected = sample_tokens_ref(logits, temperatures, gumbel_noise(seeds, logits.shape[1]))
    assert tokens.dtype == torch.int64 and tokens.shape == (logits.shape[0],)
    assert torch.equal(tokens, expected), (tokens, expected)
    return tokens


@pytest.mark.parametrize("dtype, num_chunks", [(torch.float32, 0), (torch.float16, 3), (torch.bfloat16, 2)])
def test_matches_reference_with_the_kernels_noise(dtype, num_chunks):
    torch.manual_seed(0)
    vocab = 2500  # ragged: the last tile is partial
    # Rows are views into a wider buffer: the row stride is not the vocabulary size.
    logits = (3 * torch.randn(5, vocab + 37, device=DEVICE)).to(dtype)[:, :vocab]
    temperatures = torch.tensor([0.0, 1.0, 0.3, 2.5, 0.0], device=DEVICE)
    seeds = torch.tensor([11, 12, 13, 2**62 + 1, 15], device=DEVICE)
    tokens = check_against_reference(logits, temperatures, seeds, num_chunks)
    greedy = temperatures == 0
    assert torch.equal(tokens[greedy], logits[greedy].argmax(dim=-1))
    assert not torch.equal(tokens[~greedy], logits[~greedy].argmax(dim=-1))  # the noise does something


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ties_go_to_the_smallest_index(dtype):
    vocab = 5000  # num_chunks=3: chunks [0, 2048), [2048, 4096), [4096, 5000) of 1024-logit tiles
    logits = torch.randn(5, vocab, device=DEVICE).to(dtype)
    ties = {0: (100, 4500),  # in chunks 0 and 2
            1: (2100, 2100 + 1024),  # one chunk, same lane of two tiles
            2: (11, 10),  # one tile, neighbouring lanes
            3: (4999, 4096)}  # the partial last tile
    for row, ids in ties.items():
        logits[row, list(ids)] = 10.0
    # Distinct in float32, equal once rounded to bfloat16: the tie then goes to the smaller id.
    logits[4, 700], logits[4, 3000] = 10.01, 10.02
    logits = logits.to(dtype)
    expected = logits.argmax(dim=-1)
    assert expected[:4].tolist() == [100, 2100, 10, 4096]
    assert expected[4].item() == (700 if dtype == torch.bfloat16 else 3000)
    temperatures = torch.zeros(5, device=DEVICE)
    seeds = torch.zeros(5, dtype=torch.int64, device=DEVICE)
    for num_chunks in (1, 3, 0):
        assert torch.equal(sample_tokens(logits, temperatures, seeds, num_chunks=num_chunks), expected)


def test_banned_tokens_are_never_drawn():
    torch.manual_seed(1)
    vocab = 3000
    logits = torch.randn(6, vocab, device=DEVICE)
    logits[(torch.rand(6, vocab, device=DEVICE) < 0.5) | (logits > 1.0)] = float("-inf")  # every likely token
    logits[4] = float("-inf")
    logits[4, 2777] = -50.0  # the only allowed token, in the last chunk
    logits[5] = float("-inf")  # nothing allowed: any in-range id, never a crash
    banned = logits == float("-inf")
    temperatures = torch.tensor([1.0, 5.0, 100.0, 0.0, 3.0, 1.0], device=DEVICE)
    seeds = torch.arange(6, device=DEVICE)
    for num_chunks in (1, 3):
        tokens = check_against_reference(logits, temperatures, seeds, num_chunks)
        assert not banned[torch.arange(5), tokens[:5]].any()
        assert tokens[4].item() == 2777
        assert 0 <= tokens[5].item() < vocab


def test_nan_logits_are_never_drawn():
    """A NaN logit never wins (torch.argmax would pick it): the answer is the reference's with NaN
    read as -inf, greedy or sampled, whatever the chunking."""
    torch.manual_seed(2)
    vocab = 2300
    logits = torch.randn(4, vocab, device=DEVICE)
    logits[0, 5] = logits[1, 2100] = logits[2, :700] = logits[3, 1500:] = float("nan")
    temperatures = torch.tensor([0.0, 1.0, 0.5, 0.0], device=DEVICE)
    seeds = torch.arange(4, device=DEVICE)
    expected = sample_tokens_ref(logits.nan_to_num(nan=float("-inf")), temperatures, gumbel_noise(seeds, vocab))
    for num_chunks in (1, 3):
        assert torch.equal(sample_tokens(logits, temperatures, seeds, num_chunks=num_chunks), expected)


def test_each_chunk_reports_its_best_score_and_its_smallest_id():
    """What one program writes: its chunk's largest score (logits / T + noise, or the logits of a greedy
    row) and the first token id holding it; an all -inf chunk answers -inf and its first id."""
    torch.manual_seed(3)
    batch, vocab, chunk_size = 3, 5000, 2 * NOISE_TILE  # chunks [0, 2048), [2048, 4096), [4096, 5000)
    logits = torch.randn(batch, vocab, device=DEVICE)
    logits[0, [30, 1000, 2049, 4097]] = 9.0  # greedy ties inside chunks 0 (two lanes apart), 1 and 2
    logits[1, 2048:4096] = float("-inf")  # sampled row with an empty chunk
    logits[2, 4096:] = float("-inf")
    temperatures = torch.tensor([0.0, 0.8, 2.0], device=DEVICE)
    seeds = torch.tensor([7, 8, 9], device=DEVICE)
    num_chunks = triton.cdiv(vocab, chunk_size)
    chunk_values = torch.full((batch, num_chunks), float("nan"), device=DEVICE)
    chunk_ids = torch.full((batch, num_chunks), -1, dtype=torch.int64, device=DEVICE)
    sampling.sample_chunks_kernel[(batch, num_chunks)](
        logits, temperatures, seeds, chunk_values, chunk_ids, vocab, logits.stride(0), chunk_size, num_chunks,
        QUARTER=QUARTER)
    noise = gumbel_noise(seeds, vocab)
    scores = torch.where(temperatures[:, None] == 0, logits, logits / temperatures[:, None].clamp(min=1e-30) + noise)
    for c in range(num_chunks):
        chunk = scores[:, c * chunk_size:(c + 1) * chunk_size]
        assert torch.equal(chunk_values[:, c], chunk.max(dim=-1).values), c
        assert torch.equal(chunk_ids[:, c], c * chunk_size + chunk.argmax(dim=-1)), c  # argmax: the first
    assert chunk_ids[0].tolist() == [30, 2049, 4097]
    assert chunk_values[1, 1].item() == float("-inf") and chunk_ids[1, 1].item() == 2048
    assert chunk_values[2, 2].item() == float("-inf") and chunk_ids[2, 2].item() == 4096


def test_sampled_frequencies_follow_softmax_over_temperature():
    # The kernel equals argmax(logits / T + noise) exactly (tests above), so its draws follow the
    # softmax iff those of the noise do. The interpreter is too slow for thousands of rows: draw
    # the noise of one long row (independent Philox counters) and cut it into rows of 8.
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -0.5, 0.25], device=DEVICE)
    num_draws = 5000
    noise = gumbel_noise(torch.tensor([20240601], device=DEVICE), 8 * num_draws)
    assert noise.isfinite().all()
    assert abs(noise.mean().item() - EULER_GAMMA) < 0.05 and abs(noise.var().item() - math.pi**2 / 6) < 0.1
    tokens = sample_tokens_ref(logits.repeat(num_draws, 1), torch.full((num_draws,), 0.7, device=DEVICE),
                               noise.view(num_draws, 8))
    assert chi_square(tokens, (logits / 0.7).softmax(-1)) < CHI2_CRITICAL_0_001_DOF7
    # The test can fail: the same draws are far from the temperature-1 distribution.
    assert chi_square(tokens, logits.softmax(-1)) > 10 * CHI2_CRITICAL_0_001_DOF7


@needs_cuda
def test_sampled_frequencies_of_many_seeded_rows():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -0.5, 0.25], device=DEVICE)
    num_draws = 20_000
    temperatures = torch.full((num_draws,), 0.7, device=DEVICE)
    tokens = sample_tokens(logits.repeat(num_draws, 1), temperatures, torch.arange(num_draws, device=DEVICE))
    assert chi_square(tokens, (logits / 0.7).softmax(-1)) < CHI2_CRITICAL_0_001_DOF7
    assert chi_square(tokens, logits.softmax(-1)) > 10 * CHI2_CRITICAL_0_001_DOF7


def chi_square(tokens, probs):
    counts = torch.bincount(tokens.cpu(), minlength=len(probs)).double()
    expected = len(tokens) * probs.cpu().double()
    return ((counts - expected) ** 2 / expected).sum().item()


def test_same_seed_same_draw_other_seeds_other_draws():
    vocab = 1000
    logits = torch.zeros(6, vocab, device=DEVICE)  # uniform: any token may come
    temperatures = torch.ones(6, device=DEVICE)
    seeds = torch.tensor([5, 5, 6, 7, 8, 2**63 - 1], device=DEVICE)
    tokens = sample_tokens(logits, temperatures, seeds)
    assert tokens[0] == tokens[1]
    assert len(set(tokens[1:].tolist())) == 5
    assert torch.equal(sample_tokens(logits, temperatures, seeds, num_chunks=1), tokens)  # chunking plays no part


def test_empty_batch():
    logits = torch.randn(0, 100, device=DEVICE)
    empty = torch.zeros(0, device=DEVICE)
    tokens = sample_tokens(logits, empty, empty.long())
    assert tokens.shape == (0,) and tokens.dtype == torch.int64


@pytest.mark.parametrize("change, message", [
    (dict(temperatures=torch.ones(3, dtype=torch.float64)), "temperatures must be float32"),
    (dict(temperatures=torch.ones(4)), r"temperatures must be float32 \[batch=3\]"),
    (dict(seeds=torch.zeros(3, dtype=torch.int32)), "seeds must be int64"),
    (dict(seeds=torch.zeros(2, dtype=torch.int64)), r"seeds must be int64 \[batch=3\]"),
    (dict(logits=torch.zeros(3, 50, dtype=torch.int64)), "logits dtype"),
    (dict(logits=torch.zeros(150)), r"logits must be \[batch, vocab\]"),
    (dict(logits=torch.zeros(50, 3).t()), "contiguous in vocab"),
])
def test_argument_errors(change, message):
    args = dict(logits=torch.zeros(3, 50), temperatures=torch.ones(3), seeds=torch.zeros(3, dtype=torch.int64))
    args.update(change)
    with pytest.raises(AssertionError, match=message):
        sample_tokens(**{name: t.to(DEVICE) for name, t in args.items()})


@needs_cuda
def test_bf16_full_vocabulary_batch_256():
    torch.manual_seed(0)
    batch, vocab = 256, 151936
    logits = (4 * torch.randn(batch, vocab, device=DEVICE)).to(torch.bfloat16)
    temperatures = torch.where(torch.arange(batch, device=DEVICE) % 2 == 0, 0.0,
                               0.1 + 1.5 * torch.rand(batch, device=DEVICE))
    seeds = torch.randint(2**62, (batch,), device=DEVICE)
    tokens = check_against_reference(logits, temperatures, seeds)
    assert torch.equal(tokens[0::2], logits[0::2].argmax(dim=-1))
    # Batch 1 splits the vocabulary into many chunks: the same answers row by row.
    for row in (0, 1):
        assert torch.equal(sample_tokens(logits[row:row + 1], temperatures[row:row + 1], seeds[row:row + 1]),
                           tokens[row:row + 1])


# ------------------------------------------------------------------------------------------------
# Known wrong answers: each must fail a check that grades exercise 09.1. A wrong kernel is the test's
# copy of sample_chunks_kernel below with one piece broken, launched where sample_tokens launches
# the engine's; a wrong _gumbel goes into the engine's noise kernels.
# ------------------------------------------------------------------------------------------------

PIECES = ["nothing", "no_noise", "ties_to_the_last", "exponential_noise", "noise_by_chunk_position",
          "past_the_end_read_as_zero", "largest_id_of_the_tied_lanes"]
NOTHING, NO_NOISE, TIES_TO_THE_LAST, EXPONENTIAL_NOISE, NOISE_BY_CHUNK_POSITION, PAST_THE_END_READ_AS_ZERO, \
    LARGEST_ID_OF_THE_TIED_LANES = (tl.constexpr(i) for i in range(len(PIECES)))


@triton.jit
def _fold_quarter(row_ptr, offs, end, u, temperature, best_value, best_id, BROKEN: tl.constexpr):
    """One quarter-tile into each lane's best (score, token id)."""
    if BROKEN == PAST_THE_END_READ_AS_ZERO:
        score = tl.load(row_ptr + offs, mask=offs < end, other=0.0).to(tl.float32)
    else:
        score = tl.load(row_ptr + offs, mask=offs < end, other=float("-inf")).to(tl.float32)
    if temperature != 0.0:
        u = tl.minimum(tl.maximum(u, UNIFORM_MIN), UNIFORM_MAX)
        if BROKEN == EXPONENTIAL_NOISE:
            noise = -tl.log(u)
        else:
            noise = -tl.log(-tl.log(u))
        if BROKEN == NO_NOISE:
            noise = noise * 0.0
        score = tl.div_rn(score, temperature) + noise
    if BROKEN == TIES_TO_THE_LAST:
        better = score >= best_value
    else:
        better = score > best_value
    return tl.where(better, score, best_value), tl.where(better, offs, best_id)


@triton.jit(do_not_specialize=["num_chunks"])
def sample_chunks_with_one_piece_broken(
    logits_ptr, temperatures_ptr, seeds_ptr, chunk_values_ptr, chunk_ids_ptr,
    vocab_size, stride_row, chunk_size, num_chunks,
    QUARTER: tl.constexpr, BROKEN: tl.constexpr,
):
    """sample_chunks_kernel in one body, with the piece BROKEN names broken (NOTHING: none)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temperatures_ptr + row)
    seed = tl.load(seeds_ptr + row)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    start = chunk * chunk_size
    end = tl.minimum(start + chunk_size, vocab_size)
    lanes = tl.arange(0, QUARTER)
    best_value = tl.full([QUARTER], float("-inf"), dtype=tl.float32)
    best_id = tl.full([QUARTER], 0, dtype=tl.int32) + start
    for tile_start in range(start, end, 4 * QUARTER):
        if BROKEN == NOISE_BY_CHUNK_POSITION:
            u0, u1, u2, u3 = tl.rand4x(seed, (tile_start - start) // 4 + lanes)
        else:
            u0, u1, u2, u3 = tl.rand4x(seed, tile_start // 4 + lanes)
        best_value, best_id = _fold_quarter(row_ptr, tile_start + lanes, end, u0, temperature, best_value, best_id,
                                            BROKEN)
        best_value, best_id = _fold_quarter(row_ptr, tile_start + QUARTER + lanes, end, u1, temperature, best_value,
                                            best_id, BROKEN)
        best_value, best_id = _fold_quarter(row_ptr, tile_start + 2 * QUARTER + lanes, end, u2, temperature,
                                            best_value, best_id, BROKEN)
        best_value, best_id = _fold_quarter(row_ptr, tile_start + 3 * QUARTER + lanes, end, u3, temperature,
                                            best_value, best_id, BROKEN)
    value = tl.max(best_value, 0)
    if BROKEN == LARGEST_ID_OF_THE_TIED_LANES:
        index = tl.max(tl.where(best_value == value, best_id, start), 0)
    else:
        index = tl.min(tl.where(best_value == value, best_id, end), 0)
    out = row.to(tl.int64) * num_chunks + chunk
    tl.store(chunk_values_ptr + out, value)
    tl.store(chunk_ids_ptr + out, index.to(tl.int64))


def one_piece_broken(piece: str) -> KernelWithOnePieceBroken:
    """Stands in for the engine's kernel: launches sample_chunks_with_one_piece_broken with `piece` broken."""
    return KernelWithOnePieceBroken(sample_chunks_with_one_piece_broken, PIECES, piece)


@triton.jit
def gumbel_with_one_log(u):
    """Exponential noise, -log(u): the race's times, not their logarithms."""
    return -tl.log(tl.minimum(tl.maximum(u, UNIFORM_MIN), UNIFORM_MAX))


@builds_on_the_engine
def test_the_kernel_as_the_wrong_answers_write_it_passes(monkeypatch):
    """The copy with nothing broken is right: each wrong answer below differs from it in one piece."""
    monkeypatch.setattr(sampling, "sample_chunks_kernel", one_piece_broken("nothing"))
    check_reference()
    check_ties()
    test_banned_tokens_are_never_drawn()
    test_each_chunk_reports_its_best_score_and_its_smallest_id()


def check_reference():
    test_matches_reference_with_the_kernels_noise(torch.float32, 3)


def check_ties():
    test_greedy_ties_go_to_the_smallest_index(torch.float32)


@builds_on_the_engine
@pytest.mark.parametrize("piece, check", [
    ("no_noise", check_reference),  # the trivial answer: argmax(logits / T)
    ("ties_to_the_last", check_ties),
    ("exponential_noise", check_reference),
    ("noise_by_chunk_position", check_reference),
    ("past_the_end_read_as_zero", test_banned_tokens_are_never_drawn),
    ("largest_id_of_the_tied_lanes", check_ties),
    ("largest_id_of_the_tied_lanes", test_each_chunk_reports_its_best_score_and_its_smallest_id),
], ids=case_id)
def test_the_sampling_checks_reject_a_wrong_kernel(piece, check):
    rejected(check, sampling, "sample_chunks_kernel", one_piece_broken(piece))


@builds_on_the_engine
def test_the_frequency_check_rejects_the_wrong_noise(monkeypatch):
    # Fresh copies of the noise kernels, so that a compiled one cannot keep the right _gumbel (GPU).
    for name in ("_tile_noise", "gumbel_noise_kernel"):
        monkeypatch.setattr(sampling, name, triton.jit(getattr(sampling, name).fn))
    rejected(test_sampled_frequencies_follow_softmax_over_temperature, sampling, "_gumbel", gumbel_with_one_log)
