"""Sampler: greedy, top-k/top-p filtering, the sampled distribution, and seeded reproducibility,
on the torch path (CPU) and the Triton kernel path (CUDA; on CPU through the interpreter)."""
import math

import pytest
import torch

from minivllm.core.sequence import Sequence
from minivllm.kernels import gumbel_noise, sample_tokens_ref
from minivllm.engine.sampler import Sampler, SamplingTensors, apply_top_k_only, apply_top_k_top_p, derive_seed
from minivllm.sampling_params import SamplingParams

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu,
                                               pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]

# Chi-square critical values at p = 0.001 (a correct sampler fails 1 in 1000 runs; seeds are fixed anyway).
CHI2_CRITICAL_0_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}


def draw(logits_row, num_draws, temperature=1.0, top_k=None, top_p=None, device="cpu"):
    """num_draws samples from one row of logits, batched as num_draws identical rows."""
    logits = torch.tensor(logits_row, device=device).repeat(num_draws, 1)
    temperatures = torch.full((num_draws,), temperature, device=device)
    top_ks = None if top_k is None else torch.full((num_draws,), top_k, device=device)
    top_ps = None if top_p is None else torch.full((num_draws,), top_p, device=device)
    return Sampler()(logits, tensors(temperatures, top_ks, top_ps)).cpu()


def tensors(temperatures, top_ks=None, top_ps=None, all_greedy=False):
    """A batch's SamplingTensors given row by row (no sequences)."""
    return SamplingTensors(temperatures, top_ks, top_ps, all_greedy)


def chi_square(token_ids, expected_probs):
    counts = torch.bincount(token_ids, minlength=len(expected_probs)).tolist()
    n = len(token_ids)
    kept = [i for i, p in enumerate(expected_probs) if p > 0]
    assert all(counts[i] == 0 for i in range(len(expected_probs)) if i not in kept), f"drew a filtered token: {counts}"
    stat = sum((counts[i] - n * expected_probs[i]) ** 2 / (n * expected_probs[i]) for i in kept)
    return stat, len(kept) - 1


def softmax_by_hand(values):
    exps = [math.exp(v) for v in values]
    return [e / sum(exps) for e in exps]


@pytest.mark.parametrize("device", DEVICES)
def test_temperature_sampling_matches_the_softmax(device):
    torch.manual_seed(0)
    logits = [2.0, 1.0, 0.5, 0.0, -1.0]
    expected = softmax_by_hand([x / 0.7 for x in logits])
    stat, dof = chi_square(draw(logits, 20_000, temperature=0.7, device=device), expected)
    assert stat < CHI2_CRITICAL_0_001[dof], stat
    # The test can fail: the same draws are far from the temperature-1 distribution.
    stat_wrong, _ = chi_square(draw(logits, 20_000, temperature=0.7, device=device), softmax_by_hand(logits))
    assert stat_wrong > 10 * CHI2_CRITICAL_0_001[dof]


@pytest.mark.parametrize("device", DEVICES)
def test_top_p_sampling_draws_from_the_renormalized_nucleus(device):
    torch.manual_seed(1)
    # probabilities 0.4, 0.3, 0.2, 0.07, 0.03 in shuffled token order
    probs = {3: 0.4, 0: 0.3, 4: 0.2, 1: 0.07, 2: 0.03}
    logits = [math.log(probs[i]) for i in range(5)]
    # top_p = 0.85: 0.4 + 0.3 = 0.7 < 0.85, 0.4 + 0.3 + 0.2 = 0.9 >= 0.85 -> keep tokens 3, 0, 4.
    expected = [0.3 / 0.9, 0.0, 0.0, 0.4 / 0.9, 0.2 / 0.9]
    stat, dof = chi_square(draw(logits, 20_000, top_p=0.85, device=device), expected)
    assert stat < CHI2_CRITICAL_0_001[dof], stat


def test_top_k_then_top_p_with_temperature():
    torch.manual_seed(2)
    logits = [0.0, 3.0, 1.0, 2.0, -2.0]
    # temperature 2 -> exp(l / 2); top_k = 3 keeps tokens 1, 3, 2
    e = {i: math.exp(logits[i] / 2) for i in (1, 3, 2)}
    z = sum(e.values())
    p1, p3, p2 = e[1] / z, e[3] / z, e[2] / z  # about 0.506, 0.307, 0.186
    assert p1 < 0.6 < p1 + p3  # so top_p = 0.6 keeps exactly tokens 1 and 3
    expected = [0.0, p1 / (p1 + p3), 0.0, p3 / (p1 + p3), 0.0]
    stat, dof = chi_square(draw(logits, 20_000, temperature=2.0, top_k=3, top_p=0.6), expected)
    assert stat < CHI2_CRITICAL_0_001[dof], stat


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_sampling_draws_from_the_renormalized_top_k(device):
    torch.manual_seed(4)
    logits = [0.5, -1.0, 1.5, 0.0, 1.0]
    kept = softmax_by_hand([1.5, 1.0, 0.5])  # tokens 2, 4, 0
    expected = [kept[2], 0.0, kept[0], 0.0, kept[1]]
    stat, dof = chi_square(draw(logits, 20_000, top_k=3, device=device), expected)
    assert stat < CHI2_CRITICAL_0_001[dof], stat


@pytest.mark.parametrize("top_p, kept", [(0.3, {2}), (0.5, {2}), (0.75, {2, 0}), (0.81, {2, 0, 3}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    logits = torch.tensor([[math.log(0.3), math.log(0.05), math.log(0.5), math.log(0.15)]])
    filtered = apply_top_k_top_p(logits, None, torch.tensor([top_p]))
    assert {i for i in range(4) if filtered[0, i] > float("-inf")} == kept
    assert torch.equal(filtered[0, list(kept)], logits[0, list(kept)])  # kept logits untouched


@pytest.mark.parametrize("top_k_filter", [apply_top_k_only, lambda logits, ks: apply_top_k_top_p(logits, ks, None)])
def test_top_k_per_row(top_k_filter):
    logits = torch.tensor([[0.1, 0.4, 0.3, 0.2], [0.1, 0.4, 0.3, 0.2], [0.1, 0.4, 0.3, 0.2]])
    filtered = top_k_filter(logits, torch.tensor([1, 3, 4]))
    assert (filtered > float("-inf")).tolist() == [[False, True, False, False], [False, True, True, True], [True] * 4]
    assert torch.equal(filtered[2], logits[2])


def test_top_k_1_and_greedy_rows_equal_argmax():
    torch.manual_seed(3)
    logits = torch.randn(16, 1000)
    argmax = logits.argmax(dim=-1)
    top1 = Sampler()(logits, tensors(torch.full((16,), 1.5), top_ks=torch.ones(16, dtype=torch.int64)))
    assert torch.equal(top1, argmax)
    temperatures = torch.tensor([0.0, 1.0] * 8)
    mixed = Sampler()(logits, tensors(temperatures))
    assert torch.equal(mixed[0::2], argmax[0::2])
    assert not torch.equal(mixed[1::2], argmax[1::2])  # sampled rows are not all argmax at vocab 1000
    assert torch.equal(Sampler()(logits, tensors(torch.zeros(16), all_greedy=True)), argmax)


def make_seq(params, num_completion_tokens=0):
    seq = Sequence([1, 2, 3], params)
    for _ in range(num_completion_tokens):
        seq.append_token(4)
    return seq


def sample_seqs(seqs, logits):
    tensors = SamplingTensors.from_sequences(seqs, logits.shape[-1], logits.device, eos_token_id=0)
    return Sampler()(logits, tensors).cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_reproduce_whatever_else_is_in_the_batch(device):
    vocab = 500
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(0)).to(device)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    outputs = []
    for batch_seed, position, batch_size in [(1, 0, 1), (2, 3, 5), (3, 7, 8)]:
        torch.manual_seed(batch_seed)  # different global RNG state for the unseeded rows
        tokens = []
        for step in range(20):
            others = [make_seq(SamplingParams(temperature=0.8, top_p=0.9)) for _ in range(batch_size - 1)]
            seqs = others[:position] + [make_seq(seeded, step)] + others[position:]
            logits = torch.randn(batch_size, vocab, device=device)
            logits[position] = row
            tokens.append(sample_seqs(seqs, logits)[position].item())
        outputs.append(tokens)
    assert outputs[0] == outputs[1] == outputs[2]
    assert len(set(outputs[0])) > 5  # each step draws fresh noise
    other_seed = [sample_seqs([make_seq(SamplingParams(seed=99), s)], row[None]).item() for s in range(20)]
    assert other_seed != outputs[0]


def test_sampling_tensors_from_sequences():
    seqs = [make_seq(SamplingParams(temperature=0.0)),
            make_seq(SamplingParams(temperature=0.5, top_k=10, seed=3), 2),
            make_seq(SamplingParams(top_p=0.9, top_k=5000))]
    t = SamplingTensors.from_sequences(seqs, vocab_size=100, device="cpu", eos_token_id=0)
    assert t.temperatures.tolist() == [0.0, 0.5, 1.0]
    assert t.top_ks.tolist() == [100, 10, 100] and t.top_ps.tolist() == pytest.approx([1.0, 1.0, 0.9])
    assert t.generators[0] is None and t.generators[1] is not None and t.generators[2] is None
    assert not t.all_greedy and t.banned is None
    greedy = SamplingTensors.from_sequences(seqs[:1], 100, "cpu")
    assert greedy.all_greedy and greedy.top_ks is None and greedy.top_ps is None and greedy.generators is None


def test_min_tokens_bans_eos_and_stop_token_ids():
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7])
    logits = torch.zeros(1, 10)
    logits[0, 0], logits[0, 7], logits[0, 5] = 10.0, 9.0, 1.0  # EOS (0), then stop id 7, then 5
    assert sample_seqs([make_seq(params, 0)], logits).item() == 5
    assert sample_seqs([make_seq(params, 1)], logits).item() == 5
    assert sample_seqs([make_seq(params, 2)], logits).item() == 0
    ignore = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert sample_seqs([make_seq(ignore, 0)], logits).item() == 0  # EOS is not a stop token here


def test_kernel_path_sampling_tensors(kernel_device):
    seqs = [make_seq(SamplingParams(temperature=0.0)), make_seq(SamplingParams(seed=7), 3),
            make_seq(SamplingParams(top_p=0.9)), make_seq(SamplingParams(seed=7), 4)]
    t = SamplingTensors.from_sequences(seqs, 100, kernel_device, generator=torch.Generator().manual_seed(0))
    assert t.generators is None and t.seeds.dtype == torch.int64 and t.seeds.shape == (4,)
    seeds = t.seeds.tolist()
    assert seeds[1] == derive_seed(7, 3) and seeds[3] == derive_seed(7, 4) and seeds[1] != seeds[3]
    again = SamplingTensors.from_sequences(seqs, 100, kernel_device, generator=torch.Generator().manual_seed(0))
    assert again.seeds.tolist() == seeds  # unseeded rows: reproducible given the generator
    assert all(0 <= seed < 2**63 for seed in seeds) and len(set(seeds)) == 4
    greedy = SamplingTensors.from_sequences(seqs[:1], 100, kernel_device)
    assert greedy.all_greedy and greedy.seeds is None and greedy.generators is None


def test_kernel_path_seeded_rows_reproduce_whatever_else_is_in_the_batch(kernel_device):
    vocab = 500
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(0)).to(kernel_device, torch.bfloat16)
    seeded = SamplingParams(temperature=0.8, seed=1234)
    # Alone and next to plain rows: the fused kernel; next to top-p rows: torch filters, the kernel draws.
    neighbours = [SamplingParams(temperature=0.5), SamplingParams(top_p=0.9), SamplingParams(temperature=0.0)]
    for step in range(6):
        expected = sample_tokens_ref(row[None], torch.tensor([0.8], device=kernel_device),
                                     gumbel_noise(torch.tensor([derive_seed(1234, step)], device=kernel_device), vocab))
        for others in ([], neighbours[:1], neighbours[1:2], neighbours):
            position = min(1, len(others))
            seqs = [make_seq(p) for p in others]
            seqs.insert(position, make_seq(seeded, step))
            logits = torch.randn(len(seqs), vocab, device=kernel_device).to(torch.bfloat16)
            logits[position] = row
            assert sample_seqs(seqs, logits)[position] == expected.item(), (step, others)


def test_kernel_path_greedy_and_min_tokens_in_bf16(kernel_device):
    logits = torch.randn(3, 300, device=kernel_device).to(torch.bfloat16)
    logits[:, 0] = 20.0  # EOS would win every row
    logits[0, 5] = logits[0, 9] = 10.0  # a greedy tie behind EOS: the smaller id
    seqs = [make_seq(SamplingParams(temperature=0.0, min_tokens=1)),
            make_seq(SamplingParams(temperature=0.0)),
            make_seq(SamplingParams(temperature=1.0, min_tokens=3), 1)]
    tokens = sample_seqs(seqs, logits)
    assert tokens[0] == 5 and tokens[1] == 0
    assert tokens[2] != 0 and 0 <= tokens[2] < 300
