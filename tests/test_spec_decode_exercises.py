"""Speculative decoding's two algorithms, graded for chapter 15's exercises: the n-gram proposer's
exact proposals (longest n first, the most recent occurrence, the period past the end, the lookup
bounds, no match) and the rejection rule (greedy rows and the accepted prefix exactly, where p and q
decide them; every emitted token distributed as the target's p, by a chi-square test over 40,000
draws; its randomness from its own generator), then the engine generating with both.

With tests/test_spec_decode.py they grade exercises 15.1 (the NgramProposer class and its _continue) and
15.2 (rejection_sample); the known wrong answers at the end must fail them (the grader can fail).
"""
import random
import sys

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.engine.ngram_proposer import NgramProposer
from minivllm.engine.rejection_sampler import RejectionOutput, rejection_sample
from wrong_answers import builds_on_the_engine, case_id, rejected

# Chi-square critical values at p = 0.001 (a correct rule fails 1 run in 1000; the seeds are fixed anyway).
CHI2_CRITICAL_0_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


# ---------------------------------------------------------------------------------------- 15.1 n-gram
def test_the_longest_suffix_wins_over_a_more_recent_shorter_one():
    #         0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3]
    # (1, 2, 3) occurred at 0, followed by 9 5 2; the shorter (2, 3) and (3) last occurred at 5 and 6
    assert NgramProposer(3, 1, 3).propose(tokens) == [9, 5, 2]
    assert NgramProposer(3, 1, 4).propose(tokens) == [9, 5, 2]  # no 4-gram match: n = 3 next
    assert NgramProposer(3, 1, 2).propose(tokens) == [8, 1, 2]  # n <= 2: the most recent (2, 3)
    assert NgramProposer(3, 1, 1).propose(tokens) == [8, 1, 2]


def test_prompt_lookup_max_bounds_the_suffix():
    #         0  1  2  3   4  5  6  7   8  9 10 11 12
    tokens = [1, 2, 3, 4, 10, 2, 3, 4, 11, 1, 2, 3, 4]
    assert NgramProposer(3, 2, 4).propose(tokens) == [10, 2, 3]  # (1, 2, 3, 4) at 0
    assert NgramProposer(3, 2, 3).propose(tokens) == [11, 1, 2]  # at most 3: (2, 3, 4), last at 5


def test_the_most_recent_occurrence_of_the_suffix_wins():
    #         0  1  2  3  4  5  6  7  8
    tokens = [4, 5, 6, 4, 5, 7, 0, 4, 5]
    assert NgramProposer(3, 2, 2).propose(tokens) == [7, 0, 4]  # (4, 5) at 0 and 3: the one at 3


def test_a_match_near_the_end_continues_with_its_period():
    assert NgramProposer(4, 1, 3).propose([7, 7, 7]) == [7, 7, 7, 7]  # (7, 7) at 0: period 1
    assert NgramProposer(5, 1, 3).propose([1, 2, 1, 2, 1]) == [2, 1, 2, 1, 2]  # (1, 2, 1) at 0: period 2
    # (1, 2) at 1, followed by 8 3 1 2 and then, period 4, 8 3 again
    assert NgramProposer(6, 1, 2).propose([9, 1, 2, 8, 3, 1, 2]) == [8, 3, 1, 2, 8, 3]


def test_k_tokens_when_more_follow():
    assert NgramProposer(3, 2, 3).propose([1, 2, 3, 4, 5, 6, 7, 1, 2]) == [3, 4, 5]
    assert NgramProposer(1, 1, 3).propose([1, 2, 3, 4, 5, 6, 7, 1, 2]) == [3]


def test_prompt_lookup_min_bounds_the_suffix_and_no_match_is_no_proposal():
    assert NgramProposer(3, 2, 3).propose([1, 2, 3, 4, 5, 3]) == []  # only the 1-gram (3) occurred
    assert NgramProposer(3, 1, 3).propose([1, 2, 3, 4, 5, 3]) == [4, 5, 3]
    assert NgramProposer(3, 1, 3).propose([1, 2, 3, 4, 5]) == []
    assert NgramProposer(2, 1, 3).propose([4, 5]) == []
    assert NgramProposer(2, 1, 3).propose([4, 4]) == [4, 4]
    assert NgramProposer(2, 1, 3).propose([4]) == []
    assert NgramProposer(2, 1, 3).propose([]) == []


def test_proposals_are_lists_of_python_ints():
    drafts = NgramProposer(4, 1, 3).propose([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 1, 4])
    assert drafts == [1, 5, 9, 2] and type(drafts) is list and all(type(t) is int for t in drafts)


def settings_error(**kwargs) -> str | None:
    """The message of the ValueError that building a proposer with these settings raises (None: none)."""
    try:
        NgramProposer(**kwargs)
    except ValueError as e:
        return str(e)
    return None


def test_settings_are_checked_when_the_proposer_is_built():
    for kwargs, message in [
        (dict(num_speculative_tokens=0), "num_speculative_tokens must be an integer >= 1, got 0"),
        (dict(num_speculative_tokens=2.0), "num_speculative_tokens must be an integer >= 1, got 2.0"),
        (dict(num_speculative_tokens=2, prompt_lookup_max=False), "prompt_lookup_max must be an integer >= 1"),
        (dict(num_speculative_tokens=2, prompt_lookup_min=0), "prompt_lookup_min must be an integer >= 1"),
        (dict(num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=2), "must not exceed"),
    ]:
        error = settings_error(**kwargs)
        assert error is not None and message in error, f"NgramProposer(**{kwargs}): {error!r}, expected {message!r}"
    assert settings_error(num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=3) is None
    assert NgramProposer(2, 3, 3).propose([1, 2, 3, 9, 1, 2, 3]) == [9, 1]  # min = max: one n only
    assert NgramProposer(2) == NgramProposer(2, 1, 3)  # the defaults


# ---------------------------------------------------------------------------------- 15.2 the rule
def one_hot(ids, vocab) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def assert_repeated(got: list, expected: list, repeats: int) -> None:
    """`got` is `expected` repeated `repeats` times. The message names the first row that differs: pytest's
    full diff of two long lists (what it prints when it runs on CI) takes minutes."""
    assert len(got) == len(expected) * repeats, f"{len(got)} rows, expected {len(expected) * repeats}"
    wrong = [i for i, row in enumerate(got) if row != expected[i % len(expected)]]
    assert not wrong, (f"{len(wrong)} of {len(got)} rows differ; row {wrong[0]} is {got[wrong[0]]}, "
                       f"expected {expected[wrong[0] % len(expected)]}")


def test_greedy_rows_ignore_q_and_take_the_argmax():
    """Greedy rows accept while d_i is argmax p_i, then emit argmax p_i, whatever q says; a sampled
    row of the same batch follows the rule (p one-hot: its outcome is certain). Each row 50 times."""
    vocab, repeats = 6, 50
    p = one_hot([[1, 2, 3, 4], [1, 5, 3, 4], [1, 2, 0, 0]], vocab) * 0.7 + 0.05  # argmaxes as listed
    p[2] = one_hot([1, 2, 0, 0], vocab)
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    q = torch.full((3 * repeats, 3, vocab), 1.0 / vocab)
    for draft_probs in (None, q):
        out = rejection_sample(p.repeat(repeats, 1, 1), drafts.repeat(repeats, 1), torch.full((3 * repeats,), 3),
                               draft_probs=draft_probs, is_greedy=torch.tensor([True, True, False]).repeat(repeats),
                               generator=torch.Generator().manual_seed(0))
        assert_repeated(out.to_lists(), [[1, 2, 3, 4], [1, 5], [1, 2, 0]], repeats)
        assert_repeated(out.num_accepted.tolist(), [3, 1, 2], repeats)
        assert_repeated(out.num_emitted.tolist(), [4, 2, 3], repeats)


def test_accepted_prefix_exactly_where_p_and_q_decide_it():
    """Acceptance is certain when p_i(d_i) >= q_i(d_i) and impossible when p_i(d_i) = 0, and a
    residual max(p - q, 0) on one token makes the recovered token certain: exact outputs, each row
    repeated 200 times so that a wrong rule shows on some of them."""
    vocab, repeats = 6, 200
    # one-hot q (n-gram): drafts 1 2 3
    p = torch.stack([one_hot([1, 2, 4, 5], vocab),   # d_2 = 3 has p 0: rejected, residual = p_2 (token 4)
                     one_hot([1, 2, 3, 5], vocab),   # all accepted, bonus from p_3: 5
                     one_hot([1, 0, 0, 0], vocab),   # one draft only: accepted, then bonus from p_1: 0
                     one_hot([3, 0, 0, 0], vocab)])  # no draft: a draw from p_0
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 0, 0], [1, 0, 0]])
    out = rejection_sample(p.repeat(repeats, 1, 1), drafts.repeat(repeats, 1), torch.tensor([3, 3, 1, 0]).repeat(repeats),
                           generator=torch.Generator().manual_seed(0))
    assert_repeated(out.to_lists(), [[1, 2, 4], [1, 2, 3, 5], [1, 0], [3]], repeats)
    assert_repeated(out.num_accepted.tolist(), [2, 3, 1, 0], repeats)

    # a draft model's q: d_0 = 0 with p 0.5 > q 0.25 (accepted); d_1 = 1 with p 0 (rejected), where
    # max(p_1 - q_1, 0) is on token 3 alone (a one-hot q would redraw 2 or 3)
    p = torch.tensor([[[0.5, 0.5, 0, 0, 0, 0], [0, 0, 0.4, 0.6, 0, 0], [0, 0, 0, 0, 0, 1.0]],
                      [[0.5, 0.5, 0, 0, 0, 0], [0, 0.5, 0.5, 0, 0, 0], [0, 0, 0, 0, 1.0, 0]]])
    q = torch.tensor([[[0.25, 0.25, 0.5, 0, 0, 0], [0, 0.6, 0.4, 0, 0, 0]],
                      [[0.25, 0.25, 0.5, 0, 0, 0], [0, 0.25, 0.25, 0.5, 0, 0]]])
    drafts = torch.tensor([[0, 1], [1, 2]])  # row 1: both accepted (p >= q), bonus 4
    out = rejection_sample(p.repeat(repeats, 1, 1), drafts.repeat(repeats, 1), torch.tensor([2, 2]).repeat(repeats),
                           draft_probs=q.repeat(repeats, 1, 1), generator=torch.Generator().manual_seed(0))
    assert_repeated(out.to_lists(), [[0, 3], [1, 2, 4]], repeats)
    assert isinstance(out, RejectionOutput) and out.token_ids.shape == (2 * repeats, 3)


def chi_square(token_ids: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of the drawn tokens against `expected`, and its degrees of freedom."""
    counts = torch.bincount(token_ids, minlength=len(expected)).double()
    n = len(token_ids)
    kept = expected > 0
    assert counts[~kept].sum() == 0, f"emitted a token of probability 0: {counts.tolist()}"
    stat = ((counts[kept] - n * expected[kept].double()) ** 2 / (n * expected[kept].double())).sum()
    return float(stat), int(kept.sum()) - 1


P = torch.tensor([[0.35, 0.25, 0.20, 0.10, 0.10, 0.00],   # p_0 .. p_2 (token 5: never the target's)
                  [0.10, 0.15, 0.30, 0.40, 0.05, 0.00],
                  [0.05, 0.45, 0.10, 0.10, 0.30, 0.00]])
Q_FULL = torch.tensor([[0.10, 0.30, 0.30, 0.10, 0.10, 0.10],
                       [0.30, 0.20, 0.10, 0.10, 0.20, 0.10]])
Q_OFF_SUPPORT = torch.tensor([[0.00, 0.50, 0.00, 0.20, 0.00, 0.30],  # no mass on 0, 2, 4; mass on 5
                              [0.60, 0.00, 0.40, 0.00, 0.00, 0.00]])


@pytest.mark.parametrize("q", [None, Q_FULL, Q_OFF_SUPPORT], ids=["ngram one-hot q", "draft model q",
                                                                   "draft q off p's support"])
def test_every_emitted_token_follows_the_target_distribution(q):
    """Token j of the output, where the output is that long, is distributed as p_j (a chi-square
    test per position): the output of the rule is the target's own sampling. The drafts are what a
    draft model samples from q (drawn per trial), or an n-gram's fixed guesses (q one-hot on them)."""
    trials, k, vocab = 40_000, 2, P.shape[1]
    draws = torch.Generator().manual_seed(2)
    if q is None:
        # guesses the target finds likely, so that a wrong residual (one that can redraw d_i) shows
        drafts = torch.tensor([0, 2]).expand(trials, k)
    else:
        drafts = torch.stack([torch.multinomial(q[i], trials, replacement=True, generator=draws) for i in range(k)], 1)
    out = rejection_sample(P.expand(trials, -1, -1), drafts, torch.full((trials,), k),
                           draft_probs=None if q is None else q.expand(trials, -1, -1),
                           generator=torch.Generator().manual_seed(1))
    assert out.num_emitted.min() >= 1 and out.num_emitted.max() <= k + 1
    assert torch.equal(out.num_emitted, out.num_accepted + 1)
    for j in range(k + 1):
        reached = out.num_emitted > j
        assert int(reached.sum()) > 2000
        stat, dof = chi_square(out.token_ids[reached, j], P[j])
        assert stat < CHI2_CRITICAL_0_001[dof], (j, stat)
    # d_0 is accepted with probability sum_x min(p_0(x), q_0(x)) (one-hot q: p_0(d_0))
    rate = P[0, 0] if q is None else torch.minimum(P[0], q[0]).sum()
    assert abs(float((out.num_accepted >= 1).float().mean()) - float(rate)) < 4 * (0.25 / trials) ** 0.5


def test_the_rule_draws_from_its_own_generator():
    """Same generator seed, same outputs; torch's global random stream is left alone."""
    trials = 2000
    p = P.expand(trials, -1, -1)
    drafts = torch.tensor([0, 2]).expand(trials, 2)

    def run(seed):
        return rejection_sample(p, drafts, torch.full((trials,), 2), generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(123)
    first = run(7)
    after = torch.rand(4)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(4), after), "the rule drew from torch's global generator"
    second = run(7)
    assert second.to_lists() == first.to_lists()
    assert run(8).to_lists() != first.to_lists()


# ------------------------------------------------------------------------ both, in the engine
def test_the_engine_generates_with_the_proposer_and_the_rule(qwen3_tiny_dir):
    """Greedy tokens with n-gram drafts equal those without, and drafts were accepted; temperature
    0.8 with top_k = 1 goes through the rejection rule (p one-hot on the argmax): the greedy tokens."""
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1000) for _ in range(12)] * 3} for _ in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    top_k_1 = SamplingParams(temperature=0.8, top_k=1, max_tokens=24, ignore_eos=True)
    args = dict(device="cpu", max_model_len=128, max_num_seqs=4, kvcache_block_size=8)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    with LLM(qwen3_tiny_dir, **args) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    with LLM(qwen3_tiny_dir, **args, speculative_config=spec) as llm:
        drafted = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        sampled = [o.outputs[0].token_ids for o in llm.generate(prompts, top_k_1, use_tqdm=False)]
        metrics = {m.name: m for m in llm.get_metrics()}
    assert drafted == plain and sampled == plain
    assert metrics["vllm:spec_decode_num_accepted_tokens"].value > 0


# --------------------------------------------------------------------------------------------------
# Known wrong answers: each must fail a check that grades exercise 15.1 or 15.2
# --------------------------------------------------------------------------------------------------

def _lookup(self, token_ids, shortest_first=False, oldest=False, periodic=True, down_to=None):
    """propose with one piece swappable (the wrong answers below)."""
    tokens, k = list(token_ids), self.num_speculative_tokens
    lengths = list(range(self.prompt_lookup_max, (down_to or self.prompt_lookup_min) - 1, -1))
    for n in reversed(lengths) if shortest_first else lengths:
        starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == tokens[-n:]] if n < len(tokens) else []
        if starts:
            start = (starts[0] if oldest else starts[-1]) + n
            if not periodic:
                return tokens[start:start + k]
            for i in range(k):
                tokens.append(tokens[start + i])
            return tokens[len(token_ids):]
    return []


def propose_nothing(self, token_ids):
    """The trivial answer: never a draft (every step a plain decode)."""
    return []


def propose_the_last_token_repeated(self, token_ids):
    return [token_ids[-1]] * self.num_speculative_tokens if token_ids else []


def propose_from_the_shortest_match(self, token_ids):
    return _lookup(self, token_ids, shortest_first=True)


def propose_from_the_oldest_occurrence(self, token_ids):
    return _lookup(self, token_ids, oldest=True)


def propose_only_what_is_there(self, token_ids):
    """Stops at the end of the tokens: no period."""
    return _lookup(self, token_ids, periodic=False)


def propose_below_prompt_lookup_min(self, token_ids):
    return _lookup(self, token_ids, down_to=1)


def settings_taken_as_given(self):
    """Builds a proposer from any settings: a bad config fails later, or never."""


def settings_without_the_order_check(self):
    """Checks each setting alone, not min <= max: a lookup range that is empty."""
    for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
        value = getattr(self, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _rule(target_probs, draft_token_ids, num_draft_tokens, draft_probs=None, is_greedy=None, generator=None,
          accept="ratio", residual="p - q", bonus_from_last_draft=False, use_q=True, mask=True, own_rng=True):
    """rejection_sample with one piece swappable (the wrong answers below)."""
    batch, k_plus_1, vocab = target_probs.shape
    k, rows = k_plus_1 - 1, torch.arange(batch)
    p, drafts = target_probs.float(), draft_token_ids.long()
    q = draft_probs.float() if draft_probs is not None and use_q else \
        torch.nn.functional.one_hot(drafts, vocab).float()  # [batch, k, vocab]
    p_d, q_d = p[:, :k].gather(2, drafts[..., None])[..., 0], q.gather(2, drafts[..., None])[..., 0]
    u = torch.rand(batch, k, generator=generator if own_rng else None)
    accepted = {"ratio": u * q_d < p_d, "always": torch.ones_like(p_d, dtype=torch.bool), "p >= q": p_d >= q_d}[accept]
    if is_greedy is not None:
        accepted = torch.where(is_greedy[:, None], p[:, :k].argmax(2) == drafts, accepted)
    if mask:
        accepted &= torch.arange(k)[None] < num_draft_tokens[:, None]
    num_accepted = torch.cumprod(accepted.long(), 1).sum(1)
    rejected_at = num_accepted < num_draft_tokens
    at_bonus = (num_accepted - 1).clamp(min=0) if bonus_from_last_draft else num_accepted
    p_next = torch.where(rejected_at[:, None], p[rows, num_accepted], p[rows, at_bonus])
    dist = p_next
    if residual == "p - q" and k > 0:
        cut = (p_next - q[rows, num_accepted.clamp(max=k - 1)]).clamp(min=0)
        dist = torch.where(rejected_at[:, None] & (cut.sum(1, keepdim=True) > 0), cut, p_next)
    extra = torch.multinomial(dist, 1, generator=generator if own_rng else None)[:, 0]
    if is_greedy is not None:
        extra = torch.where(is_greedy, p_next.argmax(1), extra)
    token_ids = torch.cat([drafts, torch.zeros(batch, 1, dtype=torch.long)], 1)
    token_ids[rows, num_accepted] = extra
    return RejectionOutput(token_ids, num_accepted + 1, num_accepted)


def rule_that_always_accepts(*args, **kwargs):
    return _rule(*args, **kwargs, accept="always")


def rule_that_accepts_when_p_is_at_least_q(*args, **kwargs):
    return _rule(*args, **kwargs, accept="p >= q")


def rule_that_redraws_from_p(*args, **kwargs):
    """On a rejection, a draw from p_i itself (which can give d_i back) instead of max(p_i - q_i, 0)."""
    return _rule(*args, **kwargs, residual="p")


def rule_that_ignores_the_draft_probs(*args, **kwargs):
    """q one-hot on the drafts even when the draft model gave its probabilities."""
    return _rule(*args, **kwargs, use_q=False)


def rule_with_the_bonus_from_the_last_draft_position(*args, **kwargs):
    return _rule(*args, **kwargs, bonus_from_last_draft=True)


def rule_that_reads_drafts_past_their_number(*args, **kwargs):
    return _rule(*args, **kwargs, mask=False)


def rule_that_samples_greedy_rows(target_probs, draft_token_ids, num_draft_tokens, draft_probs=None,
                                  is_greedy=None, generator=None):
    return _rule(target_probs, draft_token_ids, num_draft_tokens, draft_probs, None, generator)


def rule_on_the_global_rng(*args, **kwargs):
    return _rule(*args, **kwargs, own_rng=False)


def check_distribution_ngram():
    test_every_emitted_token_follows_the_target_distribution(None)


def check_distribution_draft_model():
    test_every_emitted_token_follows_the_target_distribution(Q_FULL)


def test_the_rule_as_the_wrong_answers_write_it_passes():
    """_rule with no piece swapped is right: the wrong answers below differ from it in one thing."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys.modules[__name__], "rejection_sample", _rule)
        test_greedy_rows_ignore_q_and_take_the_argmax()
        test_accepted_prefix_exactly_where_p_and_q_decide_it()
        check_distribution_draft_model()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(NgramProposer, "propose", _lookup)
        test_the_longest_suffix_wins_over_a_more_recent_shorter_one()
        test_a_match_near_the_end_continues_with_its_period()


@builds_on_the_engine
@pytest.mark.parametrize("wrong", [settings_taken_as_given, settings_without_the_order_check], ids=case_id)
def test_the_proposer_checks_reject_unchecked_settings(wrong):
    rejected(test_settings_are_checked_when_the_proposer_is_built, NgramProposer, "__post_init__", wrong)


@builds_on_the_engine
@pytest.mark.parametrize("wrong, check", [
    (propose_nothing, test_the_longest_suffix_wins_over_a_more_recent_shorter_one),
    (propose_the_last_token_repeated, test_the_longest_suffix_wins_over_a_more_recent_shorter_one),
    (propose_from_the_shortest_match, test_the_longest_suffix_wins_over_a_more_recent_shorter_one),
    (propose_from_the_oldest_occurrence, test_the_most_recent_occurrence_of_the_suffix_wins),
    (propose_only_what_is_there, test_a_match_near_the_end_continues_with_its_period),
    (propose_below_prompt_lookup_min, test_prompt_lookup_min_bounds_the_suffix_and_no_match_is_no_proposal),
], ids=case_id)
def test_the_proposer_checks_reject_a_wrong_proposal(wrong, check):
    rejected(check, NgramProposer, "propose", wrong)


@builds_on_the_engine
@pytest.mark.parametrize("wrong, check", [
    (rule_that_always_accepts, check_distribution_ngram),
    (rule_that_always_accepts, test_accepted_prefix_exactly_where_p_and_q_decide_it),
    (rule_that_accepts_when_p_is_at_least_q, check_distribution_draft_model),
    (rule_that_redraws_from_p, check_distribution_ngram),
    (rule_that_ignores_the_draft_probs, test_accepted_prefix_exactly_where_p_and_q_decide_it),
    (rule_that_ignores_the_draft_probs, check_distribution_draft_model),
    (rule_with_the_bonus_from_the_last_draft_position, test_accepted_prefix_exactly_where_p_and_q_decide_it),
    (rule_that_reads_drafts_past_their_number, test_accepted_prefix_exactly_where_p_and_q_decide_it),
    (rule_that_samples_greedy_rows, test_greedy_rows_ignore_q_and_take_the_argmax),
    (rule_on_the_global_rng, test_the_rule_draws_from_its_own_generator),
], ids=case_id)
def test_the_rule_checks_reject_a_wrong_rule(wrong, check):
    # the checks call the rule through this module's name
    rejected(check, sys.modules[__name__], "rejection_sample", wrong)
