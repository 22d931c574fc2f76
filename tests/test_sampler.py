"""Sampler: greedy, top-k/top-p filtering, the sampled distribution, and seeded reproducibility,
on the torch path (CPU) and the Triton kernel path (CUDA; on CPU through the interpreter).

They grade exercise 14.1 (the filters apply_top_k_top_p and apply_top_k_only, and the core Sampler
class: its forward and its draw); the known wrong answers at the end must fail them (the grader can fail).
"""
import math
import sys

import pytest
import torch

from minivllm.core import sampler as core_sampler
from minivllm.core.sampler import Sampler as CoreSampler
from minivllm.core.sampler import SamplingMetadata
from minivllm.core.sequence import Sequence
from minivllm.kernels import gumbel_noise, sample_tokens_ref
from minivllm.engine.sampler import Sampler, SamplingTensors, apply_top_k_only, apply_top_k_top_p, derive_seed
from minivllm.sampling_params import SamplingParams
from wrong_answers import builds_on_the_engine, case_id, rejected

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


def kept(filtered):
    """Each row's kept token ids (the logits the filter left finite)."""
    return [{i for i, x in enumerate(row) if x > float("-inf")} for row in filtered.tolist()]


def top_k_with_the_top_p_filter(logits, top_ks):
    return apply_top_k_top_p(logits, top_ks, None)


def top_k_with_the_top_k_filter(logits, top_ks):
    return apply_top_k_only(logits, top_ks)


TOP_K_FILTERS = [top_k_with_the_top_p_filter, top_k_with_the_top_k_filter]


@pytest.mark.parametrize("top_k_filter", TOP_K_FILTERS, ids=case_id)
def test_top_k_per_row(top_k_filter):
    logits = torch.tensor([[0.1, 0.4, 0.3, 0.2], [0.1, 0.4, 0.3, 0.2], [0.1, 0.4, 0.3, 0.2]])
    filtered = top_k_filter(logits, torch.tensor([1, 3, 4]))
    assert (filtered > float("-inf")).tolist() == [[False, True, False, False], [False, True, True, True], [True] * 4]
    assert torch.equal(filtered[2], logits[2])


@pytest.mark.parametrize("top_k_filter", TOP_K_FILTERS, ids=case_id)
def test_top_k_keeps_every_tie_of_the_kth_logit(top_k_filter):
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 0.0]]).repeat(4, 1)
    filtered = top_k_filter(logits, torch.tensor([1, 2, 3, 6]))
    assert kept(filtered) == [{1, 3}, {1, 3}, {1, 2, 3, 4}, set(range(6))]
    assert torch.equal(filtered[3], logits[3])  # k = vocab (top-k off in that row): untouched


@pytest.mark.parametrize("top_k_filter", TOP_K_FILTERS, ids=case_id)
def test_top_k_equal_to_the_vocabulary_keeps_everything(top_k_filter):
    logits = torch.randn(3, 50)
    assert torch.equal(top_k_filter(logits, torch.full((3,), 50)), logits)


def test_top_p_1_keeps_every_token_despite_rounding():
    # Token 0 holds all but ~1e-13 of the mass: in float32 the mass before every other token rounds
    # to exactly 1.0, so "mass before < p" alone would drop them at p = 1.
    logits = torch.tensor([[30.0] + [0.0] * 7, [30.0] + [0.0] * 7])
    filtered = apply_top_k_top_p(logits, None, torch.tensor([1.0, 0.5]))
    assert kept(filtered) == [set(range(8)), {0}]
    assert torch.equal(filtered[0], logits[0])


def test_top_p_is_measured_after_top_k():
    # Top-k 2 leaves 0.4 and 0.3, renormalized 4/7 and 3/7: 4/7 >= 0.5 already, so p = 0.5 keeps one.
    logits = torch.tensor([[math.log(0.4), math.log(0.3), math.log(0.2), math.log(0.1)]]).repeat(3, 1)
    filtered = apply_top_k_top_p(logits, torch.tensor([2, 2, 4]), torch.tensor([0.5, 0.6, 0.65]))
    assert kept(filtered) == [{0}, {0, 1}, {0, 1}]


def test_core_draw_follows_the_probabilities():
    """The exponential race (the core Sampler's random_sample) draws token i with probability p_i,
    never a token of probability 0."""
    probs = [0.5, 0.0, 0.3, 0.15, 0.05]
    sampler = CoreSampler(torch.Generator().manual_seed(5))
    tokens = sampler.random_sample(torch.tensor([probs]).repeat(20_000, 1))
    assert tokens.shape == (20_000,) and tokens.dtype == torch.int64
    stat, dof = chi_square(tokens, probs)
    assert stat < CHI2_CRITICAL_0_001[dof], stat


def test_core_draw_takes_its_noise_from_its_own_generator():
    """The same generator state gives the same tokens whatever torch's global RNG did meanwhile."""
    probs = torch.full((64, 100), 0.01)
    draws = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        draws.append(CoreSampler(torch.Generator().manual_seed(7)).random_sample(probs.clone()))
    assert torch.equal(draws[0], draws[1])
    other = CoreSampler(torch.Generator().manual_seed(8)).random_sample(probs.clone())
    assert not torch.equal(other, draws[0])


def test_core_sampler_forward_filters_then_draws():
    """The core path end to end: temperature, top-k then top-p, the draw; greedy rows take the argmax."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -2.0]]).repeat(2000, 1)
    temperatures = torch.tensor([2.0, 0.0]).repeat(1000)
    metadata = SamplingMetadata(temperatures, torch.full((2000,), 3), torch.full((2000,), 0.6), False)
    tokens = CoreSampler(torch.Generator().manual_seed(1))(logits, metadata)
    assert set(tokens[0::2].tolist()) == {1, 3}  # top_k 3 then top_p 0.6 at T = 2 (see above)
    assert set(tokens[1::2].tolist()) == {1}


def core_draws(logits_row, num_draws, temperature, top_k=None, top_p=None, seed=0):
    """num_draws tokens of the core Sampler from one row of logits, batched as identical rows."""
    logits = torch.tensor([logits_row]).repeat(num_draws, 1)
    top_ks = None if top_k is None else torch.full((num_draws,), top_k)
    top_ps = None if top_p is None else torch.full((num_draws,), top_p)
    metadata = SamplingMetadata(torch.full((num_draws,), temperature), top_ks, top_ps, False)
    return CoreSampler(torch.Generator().manual_seed(seed))(logits, metadata)


def test_core_sampler_divides_by_the_temperature_before_the_softmax():
    """At T = 0.5 the core sampler's tokens follow softmax(logits / T), not softmax(logits) or
    softmax(logits * T)."""
    logits = [1.0, 0.5, 0.0, -0.5]
    tokens = core_draws(logits, 20_000, temperature=0.5)
    assert tokens.shape == (20_000,) and tokens.dtype == torch.int64
    stat, dof = chi_square(tokens, softmax_by_hand([v / 0.5 for v in logits]))
    assert stat < CHI2_CRITICAL_0_001[dof], stat


def test_core_sampler_top_k_alone_draws_from_the_renormalized_top_k():
    """Top-k without top-p: only the k most likely tokens, in their renormalized proportions."""
    logits = [2.0, 1.0, 0.5, 0.0, -1.0]
    tokens = core_draws(logits, 20_000, temperature=1.0, top_k=2)
    top2 = softmax_by_hand(logits[:2])
    stat, dof = chi_square(tokens, top2 + [0.0] * 3)
    assert stat < CHI2_CRITICAL_0_001[dof], stat


def test_core_sampler_greedy_rows_take_the_argmax_in_a_sampled_batch():
    """Temperature-0 rows are the argmax whatever the others draw; an all-greedy batch is the argmax in
    the logits' own dtype (no float32 copy changes a bfloat16 tie)."""
    torch.manual_seed(3)
    logits = torch.randn(16, 1000)
    argmax = logits.argmax(dim=-1)
    temperatures = torch.tensor([0.0, 1.0] * 8)
    tokens = CoreSampler(torch.Generator().manual_seed(0))(logits, SamplingMetadata(temperatures, None, None, False))
    assert torch.equal(tokens[0::2], argmax[0::2])
    assert not torch.equal(tokens[1::2], argmax[1::2])  # the sampled rows are not all the argmax at vocab 1000
    low = logits.bfloat16()
    greedy = CoreSampler()(low, SamplingMetadata(torch.zeros(16), None, None, True))
    assert torch.equal(greedy, low.argmax(dim=-1))


def test_core_sampler_never_chooses_a_banned_token():
    """Banned (row, token) pairs (min_tokens' EOS) are never chosen: not by the argmax of a greedy row,
    not by a draw, not in an all-greedy batch; other rows may still choose that token."""
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]]).repeat(400, 1)
    banned = torch.tensor([list(range(0, 400, 2)), [0] * 200])  # even rows may not choose token 0
    temperatures = torch.tensor([0.0, 0.0] + [1.0] * 398)
    tokens = CoreSampler(torch.Generator().manual_seed(2))(logits, SamplingMetadata(temperatures, None, None, False,
                                                                                   banned))
    assert tokens[0] == 1 and tokens[1] == 0  # greedy: the best allowed token
    assert (tokens[0::2] != 0).all() and (tokens[3::2] == 0).any()
    greedy = CoreSampler()(logits[:4], SamplingMetadata(torch.zeros(4), None, None, True, torch.tensor([[0, 2], [0, 0]])))
    assert greedy.tolist() == [1, 0, 1, 0]


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


# ------------------------------------------------------------------------------------------------
# Known wrong answers: each must fail a check that grades exercise 14.1
# ------------------------------------------------------------------------------------------------

def _sorted_filter(logits, top_ks, top_ps, mass_before_of, keep_ties=True, p_guard=True, top_p_first=False):
    """apply_top_k_top_p with one piece swappable (the wrong answers below)."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)

    def top_k():
        if keep_ties:
            kth = sorted_logits.gather(-1, (top_ks - 1).unsqueeze(1))
            sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
        else:
            ranks = torch.arange(logits.shape[-1])
            sorted_logits.masked_fill_(ranks.unsqueeze(0) >= top_ks.unsqueeze(1), float("-inf"))

    def top_p():
        outside = mass_before_of(sorted_logits.softmax(dim=-1)) >= top_ps.unsqueeze(1)
        if p_guard:
            outside &= top_ps.unsqueeze(1) < 1.0
        sorted_logits.masked_fill_(outside, float("-inf"))

    steps = [top_p, top_k] if top_p_first else [top_k, top_p]
    for step, on in zip(steps, [top_ps, top_ks] if top_p_first else [top_ks, top_ps]):
        if on is not None:
            step()
    return torch.full_like(logits, float("-inf")).scatter_(-1, sorted_ids, sorted_logits)


def mass_before(probs):
    return probs.cumsum(dim=-1) - probs


def filter_that_keeps_everything(logits, top_ks, top_ps=None):
    """The trivial answer: the logits as they came."""
    return logits.clone()


def top_p_that_drops_the_token_crossing_p(logits, top_ks, top_ps):
    """Keeps the tokens whose running total stays below p: the token that reaches p is cut."""
    return _sorted_filter(logits, top_ks, top_ps, lambda probs: probs.cumsum(dim=-1))


def top_p_without_the_p_1_guard(logits, top_ks, top_ps):
    return _sorted_filter(logits, top_ks, top_ps, mass_before, p_guard=False)


def top_p_measured_before_top_k(logits, top_ks, top_ps):
    """The nucleus of the unfiltered distribution, then top-k."""
    return _sorted_filter(logits, top_ks, top_ps, mass_before, top_p_first=True)


def top_k_by_rank_in_the_top_p_filter(logits, top_ks, top_ps):
    """Exactly k tokens by sorted position: of tied k-th logits, only those the sort put first."""
    return _sorted_filter(logits, top_ks, top_ps, mass_before, keep_ties=False)


def top_k_by_rank(logits, top_ks):
    """Exactly k tokens (topk's indices): drops the ties of the k-th logit."""
    ids = logits.topk(int(top_ks.max()), dim=-1).indices
    keep = torch.zeros_like(logits, dtype=torch.bool)
    for row, k in enumerate(top_ks.tolist()):
        keep[row, ids[row, :k]] = True
    return logits.masked_fill(~keep, float("-inf"))


def top_k_one_too_many(logits, top_ks):
    return CORE_TOP_K_ONLY(logits, (top_ks + 1).clamp(max=logits.shape[-1]))


CORE_TOP_K_ONLY = core_sampler.apply_top_k_only


def draw_the_argmax(self, probs, *args):
    return probs.argmax(dim=-1)


def draw_from_the_global_rng(self, probs, *args):
    return torch.multinomial(probs, 1).squeeze(1)


def draw_argmax_of_probs_times_q(self, probs, *args):
    q = torch.empty_like(probs).exponential_(generator=self.generator)
    return (probs * q).argmax(dim=-1)


def _core_forward(self, logits, metadata, divide=True, filter_first=False, ban=True, keep_greedy=True,
                  top_k_alone=True):
    """The core Sampler.forward with one piece swappable (the wrong samplers below)."""
    if ban and metadata.banned is not None:
        logits = logits.index_put(tuple(metadata.banned), torch.tensor(float("-inf"), dtype=logits.dtype))
    if metadata.all_greedy:
        return logits.argmax(dim=-1)
    logits = logits.float()
    greedy_ids = logits.argmax(dim=-1)
    is_greedy = metadata.temperatures == 0
    temperatures = torch.where(is_greedy, 1.0, metadata.temperatures).unsqueeze(1)

    def filtered(x):
        if metadata.top_ps is not None:
            return core_sampler.apply_top_k_top_p(x, metadata.top_ks, metadata.top_ps)
        if metadata.top_ks is not None and top_k_alone:
            return core_sampler.apply_top_k_only(x, metadata.top_ks)
        return x

    if filter_first:
        logits = filtered(logits) / temperatures
    else:
        logits = filtered(logits / temperatures if divide else logits * temperatures)
    sampled = self.random_sample(logits.softmax(dim=-1))
    return torch.where(is_greedy, greedy_ids, sampled) if keep_greedy else sampled


def _wrong_sampler(**broken):
    (what, value), = broken.items()
    return type(f"sampler_{what}_{value}", (CORE_SAMPLER,), {"forward": lambda self, logits, metadata:
                                                             _core_forward(self, logits, metadata, **broken)})


CORE_SAMPLER = CoreSampler


def check_top_p_03():
    test_top_p_keeps_the_smallest_set_reaching_p(0.3, {2})


def check_ties_in_top_p_filter():
    test_top_k_keeps_every_tie_of_the_kth_logit(top_k_with_the_top_p_filter)


def check_ties_in_top_k_filter():
    test_top_k_keeps_every_tie_of_the_kth_logit(top_k_with_the_top_k_filter)


def check_top_k_per_row():
    test_top_k_per_row(top_k_with_the_top_k_filter)


@builds_on_the_engine
@pytest.mark.parametrize("name, wrong, check", [
    ("apply_top_k_top_p", filter_that_keeps_everything, check_top_p_03),
    ("apply_top_k_only", filter_that_keeps_everything, check_top_k_per_row),
    ("apply_top_k_top_p", top_p_that_drops_the_token_crossing_p, check_top_p_03),
    ("apply_top_k_top_p", top_p_without_the_p_1_guard, test_top_p_1_keeps_every_token_despite_rounding),
    ("apply_top_k_top_p", top_p_measured_before_top_k, test_top_p_is_measured_after_top_k),
    ("apply_top_k_top_p", top_k_by_rank_in_the_top_p_filter, check_ties_in_top_p_filter),
    ("apply_top_k_only", top_k_by_rank, check_ties_in_top_k_filter),
    ("apply_top_k_only", top_k_one_too_many, check_top_k_per_row),
    ("random_sample", draw_the_argmax, test_core_draw_follows_the_probabilities),
    ("random_sample", draw_argmax_of_probs_times_q, test_core_draw_follows_the_probabilities),
    ("random_sample", draw_from_the_global_rng, test_core_draw_takes_its_noise_from_its_own_generator),
    ("CoreSampler", _wrong_sampler(divide=False), test_core_sampler_divides_by_the_temperature_before_the_softmax),
    ("CoreSampler", _wrong_sampler(filter_first=True), test_core_sampler_forward_filters_then_draws),
    ("CoreSampler", _wrong_sampler(top_k_alone=False), test_core_sampler_top_k_alone_draws_from_the_renormalized_top_k),
    ("CoreSampler", _wrong_sampler(keep_greedy=False), test_core_sampler_greedy_rows_take_the_argmax_in_a_sampled_batch),
    ("CoreSampler", _wrong_sampler(ban=False), test_core_sampler_never_chooses_a_banned_token),
], ids=case_id)
def test_the_sampler_checks_reject_a_wrong_filter_or_draw(name, wrong, check):
    # The checks call the filters and the core sampler through this module's names; the draw is the
    # core Sampler's method.
    rejected(check, CoreSampler if name == "random_sample" else sys.modules[__name__], name, wrong)
