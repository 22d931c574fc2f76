"""What LLMEngine.step returns while requests run (output_kind), caller-chosen request ids, and
abort_request, with and without async scheduling (a step launched ahead holding the request)."""
import pytest

from minivllm import LLM, SamplingParams
from minivllm.sampling_params import RequestOutputKind

ENGINE_ARGS = dict(max_model_len=256, max_num_batched_tokens=512, max_num_seqs=8, num_kvcache_blocks=64)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request, qwen3_tiny_dir):
    return LLM(qwen3_tiny_dir, async_scheduling=request.param, **ENGINE_ARGS)


def greedy(max_tokens=20, **kwargs):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def run_all(llm) -> dict[str, list]:
    outputs = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_output_kinds(llm, kind):
    reference = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for i, prompt in enumerate(PROMPTS):
        assert llm.add_request(prompt, greedy(output_kind=kind), request_id=f"p{i}") == f"p{i}"
    outputs = run_all(llm)
    for i, ref in enumerate(reference):
        outs, want = outputs[f"p{i}"], ref.outputs[0]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert all(o.prompt_token_ids == PROMPTS[i] for o in outs)
        if kind is RequestOutputKind.FINAL_ONLY:
            assert len(outs) == 1
        else:
            assert len(outs) == 20  # one output per step that gave the request a token
        if kind is RequestOutputKind.DELTA:
            assert [len(o.outputs[0].token_ids) for o in outs] == [1] * 20
            assert sum((o.outputs[0].token_ids for o in outs), []) == want.token_ids
            assert "".join(o.outputs[0].text for o in outs) == want.text
        else:
            assert outs[-1].outputs[0].token_ids == want.token_ids and outs[-1].outputs[0].text == want.text
        if kind is RequestOutputKind.CUMULATIVE:  # each output extends the one before
            assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 21))
            assert all(b.outputs[0].text.startswith(a.outputs[0].text) for a, b in zip(outs, outs[1:]))


def test_streamed_text_never_shows_a_stop_string(llm):
    text = llm.generate(PROMPTS[:1], greedy(), use_tqdm=False)[0].outputs[0].text
    stop = text[8:11]
    expected = text[:text.index(stop)]
    llm.add_request(PROMPTS[0], greedy(stop=[stop], output_kind=RequestOutputKind.DELTA), request_id="s")
    outs = run_all(llm)["s"]
    assert "".join(o.outputs[0].text for o in outs) == expected
    assert outs[-1].outputs[0].finish_reason == "stop"
    so_far = ""
    for o in outs:  # no output may hold a prefix of the stop string that is later cut
        so_far += o.outputs[0].text
        assert expected.startswith(so_far)


def test_request_ids(llm):
    assert llm.add_request([1, 2], greedy(2), request_id="mine") == "mine"
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request([1, 2], greedy(2), request_id="mine")
    with pytest.raises(TypeError):
        llm.add_request([1, 2], greedy(2), request_id=7)
    auto = llm.add_request([1, 2], greedy(2))
    assert isinstance(auto, str) and auto != "mine"
    assert set(run_all(llm)) == {"mine", auto}
    assert llm.add_request([1, 2], greedy(2), request_id="mine") == "mine"  # free again once finished
    run_all(llm)


def test_abort_request_frees_blocks_at_once(llm):
    blocks = llm.scheduler.kv_cache_manager
    llm.add_request(PROMPTS[0], greedy(40, output_kind=RequestOutputKind.DELTA), request_id="keep")
    llm.add_request(PROMPTS[1], greedy(200, output_kind=RequestOutputKind.DELTA), request_id="drop")
    llm.add_request([3] * 40, greedy(5), request_id="waiting")
    outputs = {}
    for _ in range(4):
        for out in llm.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert llm.abort_request("drop") and llm.abort_request("waiting")
    assert not llm.abort_request("drop") and not llm.abort_request("never-added")
    assert len(llm.scheduler.running) + len(llm.scheduler.waiting) == 1  # "keep" alone
    for out in run_all(llm).get("keep", []):
        outputs.setdefault(out.request_id, []).append(out)
    assert not any(o.finished for o in outputs.get("drop", []))
    assert sum(len(o.outputs[0].token_ids) for o in outputs["keep"]) == 40
    assert blocks.num_free_blocks == blocks.num_blocks and not llm.has_unfinished_requests()


def test_generate_returns_final_outputs_only(llm):
    params = greedy(5, output_kind=RequestOutputKind.DELTA)  # LLM.generate asks for FINAL_ONLY itself
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5] and all(o.finished for o in outs)
    assert params.output_kind is RequestOutputKind.DELTA  # the caller's object is not changed


def test_delta_with_n_samples_and_logprobs(llm):
    """n=2 with logprobs: the DELTA pieces of each sample add up to its final output, and a
    finished sample is reported once."""
    def params(kind):
        return SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=6, ignore_eos=True, logprobs=2,
                              output_kind=kind)

    final = llm.generate([PROMPTS[0]], params(RequestOutputKind.FINAL_ONLY), use_tqdm=False)[0]
    llm.add_request(PROMPTS[0], params(RequestOutputKind.DELTA), request_id="n2")
    outs = run_all(llm)["n2"]
    assert outs[-1].finished
    for want in final.outputs:
        pieces = [c for o in outs for c in o.outputs if c.index == want.index]
        assert sum((c.token_ids for c in pieces), []) == want.token_ids
        assert "".join(c.text for c in pieces) == want.text
        assert sum((c.logprobs for c in pieces), []) == want.logprobs
        assert [c.finish_reason for c in pieces].count("length") == 1 and pieces[-1].finish_reason == "length"


def test_abort_a_request_with_n_samples(llm):
    blocks = llm.scheduler.kv_cache_manager
    llm.add_request(PROMPTS[1], SamplingParams(n=3, max_tokens=100, ignore_eos=True), request_id="many")
    llm.step()
    llm.step()
    assert llm.abort_request("many")
    assert not llm.has_unfinished_requests() and blocks.num_free_blocks == blocks.num_blocks
    assert llm.step() == []
