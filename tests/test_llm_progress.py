"""LLM.generate's progress bar: counted in tokens, it moves during a batch, and it ends full with
every request counted as finished (also when requests stop early)."""
import pytest

from minivllm import LLM, SamplingParams
from minivllm import llm as llm_module

ENGINE_ARGS = dict(max_model_len=128, max_num_batched_tokens=512, max_num_seqs=4)


@pytest.fixture
def recorded_bar(monkeypatch):
    """Refresh after every step, and record the bar's position and postfix at each update."""
    monkeypatch.setattr(llm_module._TokenProgress, "REFRESH_S", 0.0)
    record = {"positions": [], "postfix": None, "total": None}
    original_update = llm_module._TokenProgress.update

    def update(self, finished):
        original_update(self, finished)
        record["positions"].append(self.bar.n)
        record["postfix"], record["total"] = getattr(self.bar, "postfix", None), self.bar.total

    monkeypatch.setattr(llm_module._TokenProgress, "update", update)
    return record


def test_bar_counts_tokens_as_they_come(qwen3_tiny_dir, recorded_bar):
    llm = LLM(qwen3_tiny_dir, **ENGINE_ARGS)
    max_tokens = [3, 9, 14]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate([[1, 2, 3], [4, 5], [6, 7, 8, 9]], params, use_tqdm=True)
    positions = recorded_bar["positions"]
    assert recorded_bar["total"] == sum(max_tokens)
    assert positions == sorted(positions), "the bar went backwards"
    assert positions[-1] == sum(max_tokens) == sum(len(o.outputs[0].token_ids) for o in outputs)
    # it moved during the batch, not only when requests finished (4 requests, 14 decode steps)
    assert len({p for p in positions if 0 < p < sum(max_tokens)}) >= 8
    assert "3/3 requests done" in recorded_bar["postfix"]


def test_bar_ends_full_when_requests_stop_early(qwen3_tiny_dir, recorded_bar):
    llm = LLM(qwen3_tiny_dir, **ENGINE_ARGS)
    first = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    # stop on the second greedy token: the request finishes after 2 of its 20 tokens
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[first[1]])
    out = llm.generate([[1, 2, 3]], params, use_tqdm=True)[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < 20
    assert recorded_bar["positions"][-1] == recorded_bar["total"] == 20
    assert "1/1 requests done" in recorded_bar["postfix"]


def test_bar_counts_every_sample_of_n(qwen3_tiny_dir, recorded_bar):
    llm = LLM(qwen3_tiny_dir, **ENGINE_ARGS)
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=5, ignore_eos=True)
    out = llm.generate([[1, 2, 3]], params, use_tqdm=True)[0]
    assert [len(c.token_ids) for c in out.outputs] == [5, 5, 5]
    positions = recorded_bar["positions"]
    assert recorded_bar["total"] == 15 and positions[-1] == 15 and positions == sorted(positions)
    assert any(5 < p < 15 for p in positions), "the samples' tokens were not counted as they came"
