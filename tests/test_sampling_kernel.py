"""sample_tokens (Triton, Gumbel-max) against sample_tokens_ref fed the kernel's own noise: exact ids,
greedy ties, banned tokens, the sampled distribution, seeds, argument checks.

Under the interpreter a tile with noise costs ~20 ms whatever its size: CPU shapes stay small.
"""
import math

import pytest
import torch

from conftest_kernels import DEVICE, needs_cuda  # noqa: I001 (sets TRITON_INTERPRET first)
from minivllm.kernels import gumbel_noise, sample_tokens, sample_tokens_ref

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
