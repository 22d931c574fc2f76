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


def _field_exists(name):
    return name in SamplingParams.__dataclass_fields__


def _newer(kwargs, field):
    """A case for a field that only newer versions have (skipped where the field does not exist)."""
    return pytest.param(kwargs, field, marks=pytest.mark.skipif(not _field_exists(field), reason=f"no {field}"))


BAD_VALUES = [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=None), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_p="0.5"), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=None), "max_tokens"),
    (dict(max_tokens=1.5), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=17), "min_tokens"),
    (dict(min_tokens=1.0), "min_tokens"),
    (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(ignore_eos=1), "ignore_eos"),
    (dict(stop=5), "stop"),
    (dict(stop=["ok", 3]), "stop"),
    (dict(stop=["ok", None]), "stop"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[1, -1]), "stop_token_ids"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop_token_ids="5"), "stop_token_ids"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids"),
    (dict(seed=1.5), "seed"),
    (dict(seed="42"), "seed"),
    (dict(seed=True), "seed"),
    _newer(dict(n=0), "n"),
    _newer(dict(n=2.5), "n"),
    _newer(dict(presence_penalty=2.5), "presence_penalty"),
    _newer(dict(presence_penalty=float("nan")), "presence_penalty"),
    _newer(dict(frequency_penalty=-2.5), "frequency_penalty"),
    _newer(dict(repetition_penalty=0.0), "repetition_penalty"),
    _newer(dict(repetition_penalty=float("nan")), "repetition_penalty"),
    _newer(dict(logprobs=-2), "logprobs"),
    _newer(dict(logprobs=1.5), "logprobs"),
    _newer(dict(prompt_logprobs=-2), "prompt_logprobs"),
    _newer(dict(output_kind="final"), "output_kind"),
]


@pytest.mark.parametrize("kwargs, field", BAD_VALUES)
def test_invalid_values_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", BAD_VALUES)
def test_verify_rechecks_fields_set_after_construction(kwargs, field):
    """SamplingParams is mutable: the engine calls verify() for every request it adds."""
    params = SamplingParams()
    for name, value in kwargs.items():
        setattr(params, name, value)
    with pytest.raises(ValueError, match=field):
        params.verify()


def test_edge_values_are_accepted():
    p = SamplingParams(temperature=0, top_p=1, top_k=1, max_tokens=1, min_tokens=1, seed=0)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.min_tokens, p.seed) == (0, 1, 1, 1, 1, 0)
    assert p.is_greedy
    p = SamplingParams(temperature=2.0, top_p=1e-6, top_k=-1, seed=-5, stop_token_ids=[0], stop=["x"])
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.stop_token_ids, p.stop) == (2.0, 1e-6, -1, -5, [0], ["x"])
    assert not p.is_greedy
    p.verify()  # verify() accepts what the constructor accepted, and changes nothing
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.stop_token_ids, p.stop) == (2.0, 1e-6, -1, -5, [0], ["x"])
