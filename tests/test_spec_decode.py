"""Speculative decoding's two algorithms on their own: the n-gram proposer (exact proposals) and the
rejection sampler (greedy exactly; sampling: every emitted token distributed as the target's p, checked
over many draws, far closer to p than to perturbed references; seeds reproduce). The engine's use of
them: tests/test_spec_decode_engine.py."""
import pytest
import torch

from minivllm.engine.ngram_proposer import NgramProposer
from minivllm.engine.rejection_sampler import rejection_sample


# ---------------------------------------------------------------------------------------- n-gram
def test_longest_suffix_proposes_what_followed_its_most_recent_occurrence():
    proposer = NgramProposer(num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=3)
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [7, 1, 2, 3, 4, 5, 9, 1, 2, 3, 8, 2, 3]
    # suffix (1, 2, 3)? no: the last three are (8, 2, 3) -> not earlier; (2, 3) occurred at 2 and 8: the
    # most recent (8) was followed by 8, 2
    assert proposer.propose(tokens) == [8, 2]
    assert proposer.propose([5, 1, 2, 3, 4, 1, 2, 3]) == [4, 1]  # n = 3 wins over the shorter matches
    assert NgramProposer(5, 1, 3).propose([5, 1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2, 3, 4]  # past the end: period 4


def test_no_proposal_without_a_match_of_at_least_min():
    assert NgramProposer(3, 2, 3).propose([1, 2, 3, 4, 5, 3]) == []  # only a 1-gram matches
    assert NgramProposer(3, 1, 3).propose([1, 2, 3, 4, 5, 3]) == [4, 5, 3]
    assert NgramProposer(3, 1, 3).propose([4]) == []
    assert NgramProposer(3, 1, 3).propose([]) == []


def test_a_suffix_never_matches_itself():
    # (6, 6) ends the sequence; its only earlier occurrence starts at 0, followed by 6 and (period 1) 6
    assert NgramProposer(2, 2, 2).propose([6, 6, 6]) == [6, 6]


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_speculative_tokens=0), "num_speculative_tokens must be an integer >= 1"),
    (dict(num_speculative_tokens=2, prompt_lookup_min=0), "prompt_lookup_min must be an integer >= 1"),
    (dict(num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=2), "must not exceed"),
    (dict(num_speculative_tokens=True), "num_speculative_tokens must be an integer"),
])
def test_bad_proposer_settings_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NgramProposer(**kwargs)


# ------------------------------------------------------------------------------------ rejection
def one_hot_probs(ids, vocab):
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def test_greedy_accepts_while_the_target_agrees_then_its_argmax():
    vocab = 6
    p = one_hot_probs([[1, 2, 3, 4], [1, 5, 3, 4], [0, 0, 0, 2]], vocab) * 0.7 + 0.05  # argmaxes as listed
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [0, 0, 0]])
    out = rejection_sample(p, drafts, torch.tensor([3, 3, 1]), is_greedy=torch.ones(3, dtype=torch.bool))
    # all 3 accepted + bonus 4; mismatch at 1 -> target's 5; only 1 draft token -> accepted + p_1's argmax 0
    assert out.to_lists() == [[1, 2, 3, 4], [1, 5], [0, 0]]
    assert out.num_accepted.tolist() == [3, 1, 1]


def test_no_draft_tokens_is_a_plain_draw_from_p0():
    p = one_hot_probs([[3, 1]], 5)
    out = rejection_sample(p, torch.tensor([[0]]), torch.tensor([0]), generator=torch.Generator().manual_seed(0))
    assert out.to_lists() == [[3]]


def empirical(counts_of, num_trials):
    return torch.bincount(counts_of, minlength=5).float()[:5] / num_trials


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["ngram one-hot q", "draft model q"])
def test_emitted_tokens_follow_the_target_distribution(with_draft_probs):
    """The first emitted token is distributed as p_0, and, given that the first draft token was accepted,
    the second as p_1. The draft tokens are what a draft model samples from its q (drawn per trial), or
    an n-gram's fixed guesses (q one-hot on them)."""
    torch.manual_seed(0)
    vocab, k, trials = 5, 2, 40_000
    p = torch.softmax(torch.randn(k + 1, vocab) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, vocab) * 1.5, dim=-1)
    if with_draft_probs:
        drafts = torch.stack([torch.multinomial(q[i], trials, replacement=True) for i in range(k)], dim=1)
    else:
        # guesses the target finds likely, so that a wrong residual (one that can redraw d_0) shows
        drafts = torch.stack([p[0].argmax(), p[1].argsort()[-2]]).expand(trials, -1)
    out = rejection_sample(p.expand(trials, -1, -1), drafts, torch.full((trials,), k),
                           draft_probs=q.expand(trials, -1, -1) if with_draft_probs else None,
                           generator=torch.Generator().manual_seed(1))
    first = out.token_ids[:, 0]
    tol = 4 * (0.25 / trials) ** 0.5  # 4 standard deviations of a frequency
    assert (empirical(first, trials) - p[0]).abs().max() < tol
    kept = out.num_accepted >= 1  # the first draft token was accepted
    second = out.token_ids[kept, 1]
    assert (empirical(second, int(kept.sum())) - p[1]).abs().max() < 4 * (0.25 / int(kept.sum())) ** 0.5
    # the first draft token is accepted with probability sum_x min(p(x), q(x)) (one-hot q: p_0(d_0))
    rate = torch.minimum(p[0], q[0]).sum() if with_draft_probs else p[0, drafts[0, 0]]
    assert abs(kept.float().mean() - rate) < tol


def test_a_sampler_that_ignores_rejection_is_caught():
    """The distribution check above fails for the naive rule 'always keep the draft token'."""
    torch.manual_seed(0)
    vocab, trials = 5, 40_000
    p = torch.softmax(torch.randn(2, vocab) * 1.5, dim=-1)
    always_kept = torch.full((trials,), 2)
    assert (empirical(always_kept, trials) - p[0]).abs().max() > 4 * (0.25 / trials) ** 0.5


def test_distance_to_the_target_is_far_below_the_distance_to_perturbed_targets():
    """Over several seeds of draft-model drafts, the first emitted token's empirical distribution is
    within sampling noise of p_0 (total variation), and several times closer to p_0 than to references
    that move 5% of p_0's mass from its likeliest token to another (the bias of a subtly wrong residual
    or acceptance rule). Each seed's draws reproduce."""
    torch.manual_seed(3)
    vocab, k, trials = 5, 2, 20_000
    p = torch.softmax(torch.randn(k + 1, vocab) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, vocab) * 1.5, dim=-1)
    order = p[0].argsort(descending=True)
    perturbed = []
    for to in (order[-1], order[1]):  # 5% of the mass from the likeliest token to the least likely, or the next
        ref = p[0].clone()
        ref[order[0]] -= 0.05
        ref[to] += 0.05
        perturbed.append(ref)
    tv = lambda a, b: 0.5 * (a - b).abs().sum().item()  # noqa: E731
    firsts = []
    for seed in range(5):
        drafts = torch.stack([torch.multinomial(q[i], trials, replacement=True,
                                                generator=torch.Generator().manual_seed(100 + seed)) for i in range(k)], 1)
        def draw():
            return rejection_sample(p.expand(trials, -1, -1), drafts, torch.full((trials,), k),
                                    draft_probs=q.expand(trials, -1, -1), generator=torch.Generator().manual_seed(seed))
        out = draw()
        assert torch.equal(out.token_ids, draw().token_ids)  # a seed reproduces
        firsts.append(out.token_ids[:, 0])
        emp = empirical(firsts[-1], trials)
        assert tv(emp, p[0]) < 0.02
        assert all(tv(emp, ref) > 2 * tv(emp, p[0]) for ref in perturbed)
    pooled = empirical(torch.cat(firsts), 5 * trials)
    assert all(tv(pooled, ref) > 4 * tv(pooled, p[0]) for ref in perturbed)
