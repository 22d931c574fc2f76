"""SamplingParams validation: every bad value raises ValueError naming its field."""
import pytest

from minivllm.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.min_tokens) == (1.0, 1.0, -1, 16, 0)
    assert p.ignore_eos is False and p.stop == [] and p.stop_token_ids == [] and p.seed is None
    assert not p.is_greedy and SamplingParams(temperature=0).is_greedy


def test_stop_is_normalized_to_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=None), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=17), "min_tokens"),
    (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(stop=5), "stop"),
    (dict(stop=["ok", 3]), "stop"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[1, -1]), "stop_token_ids"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(seed=1.5), "seed"),
    (dict(seed="42"), "seed"),
    (dict(seed=True), "seed"),
])
def test_invalid_values_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_edge_values_are_accepted():
    SamplingParams(temperature=0, top_p=1, top_k=1, max_tokens=1, min_tokens=1, seed=0)
    SamplingParams(temperature=2.0, top_p=1e-6, top_k=-1, seed=-5)
