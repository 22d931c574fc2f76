"""vLLM's user-facing API on CPU (float32, qwen3-tiny / llama-tiny): n, logprobs and prompt_logprobs
against transformers' log_softmax, penalties against transformers and a torch reference,
stop_reason, prompt dicts, skip_tokenizer_init / tokenizer= / get_tokenizer, and the new fields'
validation."""
import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from minivllm import LLM, Logprob, SamplingParams
from minivllm.engine.async_scheduling import PLACEHOLDER_TOKEN_ID
from minivllm.core.sequence import Sequence
from minivllm.engine.logprobs import gather_logprobs
from minivllm.engine.sampler import PenaltyTensors, Sampler, SamplingTensors, apply_penalties
from minivllm.sampling_params import MAX_LOGPROBS

# Pinned to the CPU in float32 (also on a CUDA machine): the comparisons with transformers are exact
# or to float32 noise. tests/test_gpu_api.py covers the GPU path.
ENGINE_ARGS = dict(device="cpu", dtype="float32", max_model_len=256, max_num_batched_tokens=1024, max_num_seqs=8,
                   num_kvcache_blocks=256)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [300, 2, 2, 2, 41, 7, 900, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [42]]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def llm(qwen3_tiny_dir):
    return LLM(qwen3_tiny_dir, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def hf_model(qwen3_tiny_dir):
    return AutoModelForCausalLM.from_pretrained(qwen3_tiny_dir, dtype=torch.float32).eval()


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab]: transformers' log_softmax at every position, teacher-forced on token_ids."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(dim=-1)


def check_position(position: dict, chosen: int, k: int, reference: torch.Tensor):
    """One position's {token: Logprob} against transformers' logprobs there: the chosen token
    first, then the top k; each logprob equal, each rank 1 + the tokens above it (with a margin
    for float noise between the two implementations)."""
    assert next(iter(position)) == chosen
    assert set(position) == {chosen} | set(reference.topk(k).indices.tolist()) if k else set(position) == {chosen}
    for token, entry in position.items():
        assert isinstance(entry, Logprob)
        assert entry.logprob == pytest.approx(reference[token].item(), abs=1e-4)
        above = int((reference > reference[token] + 1e-4).sum())
        at_or_above = int((reference >= reference[token] - 1e-4).sum())
        assert above + 1 <= entry.rank <= at_or_above


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_equal_transformers_log_softmax(llm, hf_model, temperature):
    k = 4
    # Penalties and temperature change what is sampled, never the raw logprobs reported.
    params = SamplingParams(temperature=temperature, max_tokens=8, logprobs=k, seed=3, ignore_eos=True,
                            repetition_penalty=1.2 if temperature else 1.0)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, outputs):
        completion = out.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids) == 8
        reference = hf_logprobs(hf_model, prompt + completion.token_ids)
        for j, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
            check_position(position, token, k, reference[len(prompt) - 1 + j])
            assert position[token].decoded_token == tokenizer.decode([token])
        expected_sum = sum(p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs))
        assert completion.cumulative_logprob == pytest.approx(expected_sum, abs=1e-6)
        if temperature == 0.0:
            assert all(p[t].rank == 1 for t, p in zip(completion.token_ids, completion.logprobs))
        assert out.prompt_logprobs is None


def test_logprobs_zero_gives_the_sampled_token_only_and_none_gives_nothing(llm):
    out = llm.generate(PROMPTS[:1], [SamplingParams(temperature=0.0, max_tokens=3, logprobs=0)], use_tqdm=False)[0]
    assert [list(p) for p in out.outputs[0].logprobs] == [[t] for t in out.outputs[0].token_ids]
    plain = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None
    assert plain.token_ids == out.outputs[0].token_ids


def test_prompt_logprobs_equal_transformers_and_skip_the_prefix_cache(llm, hf_model):
    prompt = list(range(100, 140))  # 40 tokens: two full blocks of 16 are cacheable
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # fill the cache
    again = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    assert again.num_cached_tokens == 32
    k = 3
    out = llm.generate([prompt, [7]], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=k),
                       use_tqdm=False)
    assert out[0].num_cached_tokens == 0  # every prompt position's logits were computed
    assert len(out[0].prompt_logprobs) == len(prompt) and out[0].prompt_logprobs[0] is None
    reference = hf_logprobs(hf_model, prompt)
    for i in range(1, len(prompt)):
        check_position(out[0].prompt_logprobs[i], prompt[i], k, reference[i - 1])
    assert out[1].prompt_logprobs == [None]  # a one-token prompt: nothing predicts its token
    assert out[0].outputs[0].token_ids == again.outputs[0].token_ids


def test_prompt_logprobs_of_a_long_prompt_are_computed_in_chunks(qwen3_tiny_dir, hf_model, monkeypatch):
    from minivllm.engine import logprobs

    monkeypatch.setattr(logprobs, "PROMPT_LOGPROBS_CHUNK", 7)
    engine = LLM(qwen3_tiny_dir, **ENGINE_ARGS)
    prompts = [list(range(200, 230)), list(range(10, 13))]  # 29 and 2 positions: several chunks, one
    outputs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        reference = hf_logprobs(hf_model, prompt)
        got = [p[prompt[i]].logprob for i, p in enumerate(out.prompt_logprobs[1:], start=1)]
        expected = [reference[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
        assert got == pytest.approx(expected, abs=1e-4)


class VllmPenaltiesReference(LogitsProcessor):
    """vLLM's presence/frequency penalties written plainly, for transformers' generate: counts
    over the generated tokens only (input_ids minus the prompt)."""

    def __init__(self, prompt_len, presence, frequency):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for row in range(scores.shape[0]):
            for token in set(input_ids[row, self.prompt_len:].tolist()):
                count = input_ids[row, self.prompt_len:].tolist().count(token)
                scores[row, token] -= self.frequency * count + self.presence
        return scores


def hf_generate(hf_model, prompt, num_tokens, **kwargs):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("model_fixture", ["qwen3_tiny_dir", "llama_tiny_dir"])
def test_repetition_penalty_greedy_equals_transformers(request, model_fixture):
    model_dir = request.getfixturevalue(model_fixture)
    engine = LLM(model_dir, **ENGINE_ARGS)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n = 24
    plain = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n), use_tqdm=False)
    for penalty in (1.3, 0.8):
        params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, repetition_penalty=penalty)
        outputs = engine.generate(PROMPTS, params, use_tqdm=False)
        for prompt, out in zip(PROMPTS, outputs):
            assert out.outputs[0].token_ids == hf_generate(hf, prompt, n, repetition_penalty=penalty)
        if penalty > 1:  # the penalty changed something
            assert [o.outputs[0].token_ids for o in outputs] != [o.outputs[0].token_ids for o in plain]


def test_presence_and_frequency_penalties_equal_a_reference(llm, hf_model):
    n = 24
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n), use_tqdm=False)
    for presence, frequency in [(1.5, 0.0), (0.0, 1.0), (-0.5, 0.7)]:
        params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, presence_penalty=presence,
                                frequency_penalty=frequency)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        for prompt, out, base in zip(PROMPTS, outputs, plain):
            reference = VllmPenaltiesReference(len(prompt), presence, frequency)
            assert out.outputs[0].token_ids == hf_generate(hf_model, prompt, n,
                                                           logits_processor=LogitsProcessorList([reference]))
        assert [o.outputs[0].token_ids for o in outputs] != [o.outputs[0].token_ids for o in plain]


def reference_penalties(logits, seqs):
    """vLLM's penalties row by row in plain Python loops."""
    out = logits.clone().float()
    for row, seq in enumerate(seqs):
        p = seq.sampling_params
        for token in set(seq.token_ids):
            value = out[row, token]
            out[row, token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        completion = seq.completion_token_ids
        for token in set(completion):
            out[row, token] -= p.frequency_penalty * completion.count(token) + p.presence_penalty
    return out


def test_apply_penalties_equals_a_loop_reference_with_the_last_token_from_the_device():
    vocab = 50
    params = [SamplingParams(repetition_penalty=1.7, presence_penalty=0.4, frequency_penalty=0.3),
              SamplingParams(), SamplingParams(frequency_penalty=-1.2, repetition_penalty=0.5)]
    seqs = [Sequence([1, 2, 3, 3], p) for p in params]
    for seq, completion in zip(seqs, [[3, 7, 7, 9], [4], [1, 1, 1, 49]]):
        for token in completion:
            seq.append_token(token)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)) * 3
    tensors = PenaltyTensors.from_sequences(seqs, vocab, "cpu")
    assert tensors.occurrences[0, 7] == 2 and tensors.occurrences[0, 1] == 0 and tensors.seen[0, 1]
    expected = reference_penalties(logits, seqs)
    torch.testing.assert_close(apply_penalties(logits, tensors), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(apply_penalties(logits, tensors)[1], logits[1])  # no penalty: unchanged
    # Async scheduling: the last token may still be a placeholder whose id is on the device only;
    # the penalties count the step's input (each row's last token) instead of the host's copy.
    for seq in seqs:
        seq.token_ids[-1] = PLACEHOLDER_TOKEN_ID
    filled = PenaltyTensors.from_sequences(seqs, vocab, "cpu", last_tokens=torch.tensor([9, 4, 49]))
    torch.testing.assert_close(apply_penalties(logits, filled), expected, atol=1e-6, rtol=0)
    wrong = PenaltyTensors.from_sequences(seqs, vocab, "cpu", last_tokens=torch.tensor([8, 4, 48]))
    assert not torch.allclose(apply_penalties(logits, wrong), expected)


def test_sampling_tensors_only_carry_penalties_and_logprobs_when_asked():
    seqs = [Sequence([1, 2], SamplingParams(temperature=0.0)), Sequence([3], SamplingParams(top_k=5))]
    plain = SamplingTensors.from_sequences(seqs, 10, "cpu")
    assert plain.penalties is None and plain.max_num_logprobs is None
    seqs.append(Sequence([4], SamplingParams(logprobs=2, presence_penalty=0.1)))
    seqs.append(Sequence([4], SamplingParams(logprobs=5)))
    extra = SamplingTensors.from_sequences(seqs, 10, "cpu")
    assert extra.penalties is not None and extra.max_num_logprobs == 5


def test_gather_logprobs_ranks_and_top_k():
    logprobs = torch.tensor([[-1.0, -0.5, -3.0, -0.5], [-2.0, -1.0, -0.25, -4.0]])
    out = gather_logprobs(logprobs, torch.tensor([0, 2]), 2)
    assert out.logprob_token_ids.tolist() == [[0, 1, 3], [2, 2, 1]]
    assert out.logprobs.tolist() == [[-1.0, -0.5, -0.5], [-0.25, -0.25, -1.0]]
    assert out.ranks.tolist() == [3, 1]  # ties above count against the chosen token
    only = gather_logprobs(logprobs, torch.tensor([3, 3]), 0)
    assert only.logprob_token_ids.tolist() == [[3], [3]] and only.ranks.tolist() == [2, 4]


def test_kernel_path_with_penalties_equals_the_torch_path(kernel_device):
    """Penalised logits go to the sampling kernel as float32: its greedy rows and seeded draws
    equal argmax / the reference draw over the reference-penalised logits."""
    from minivllm.kernels import gumbel_noise, sample_tokens_ref
    from minivllm.engine.sampler import derive_seed

    vocab = 300
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0), SamplingParams(temperature=0.7, seed=5,
                                                                                       frequency_penalty=1.5),
              SamplingParams(temperature=0.0)]
    seqs = [Sequence([1, 2, 3], p) for p in params]
    for seq in seqs:
        seq.append_token(4)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    logits[:, 1:5] = 5.0  # the seen tokens win without penalties,
    logits[:, 10] = 4.0  # this one with a repetition penalty of 2
    tensors = SamplingTensors.from_sequences(seqs, vocab, kernel_device)
    tokens = Sampler()(logits.to(kernel_device, torch.bfloat16), tensors).cpu()
    penalised = reference_penalties(logits.to(torch.bfloat16).float(), seqs)
    noise = gumbel_noise(torch.tensor([0, derive_seed(5, 1), 0], device=kernel_device), vocab).cpu()
    expected = sample_tokens_ref(penalised, torch.tensor([0.0, 0.7, 0.0]), noise)
    assert tokens[:2].tolist() == expected[:2].tolist() and tokens[0] == 10
    assert tokens[2] in (1, 2, 3, 4)  # the row without penalties keeps its argmax


def test_n_samples(llm):
    prompt = PROMPTS[1]
    sampled = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=11, ignore_eos=True),
                           use_tqdm=False)
    assert len(sampled) == 1 and [c.index for c in sampled[0].outputs] == [0, 1, 2]
    token_ids = [c.token_ids for c in sampled[0].outputs]
    assert len({tuple(t) for t in token_ids}) == 3 and all(len(t) == 10 for t in token_ids)
    again = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=11, ignore_eos=True),
                         use_tqdm=False)
    assert [c.token_ids for c in again[0].outputs] == token_ids  # a seeded request reproduces
    alone = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=10, seed=11, ignore_eos=True),
                         use_tqdm=False)
    assert alone[0].outputs[0].token_ids == token_ids[0]  # sample 0 uses the request's seed
    greedy = llm.generate([prompt, PROMPTS[0]], SamplingParams(n=2, temperature=0.0, max_tokens=6, logprobs=1),
                          use_tqdm=False)
    for out in greedy:
        assert len(out.outputs) == 2 and out.finished
        assert out.outputs[0].token_ids == out.outputs[1].token_ids
        assert out.outputs[0].cumulative_logprob == pytest.approx(out.outputs[1].cumulative_logprob, abs=1e-5)
    unseeded = llm.generate([prompt], SamplingParams(n=2, temperature=1.0, max_tokens=10, ignore_eos=True),
                            use_tqdm=False)[0]
    assert unseeded.outputs[0].token_ids != unseeded.outputs[1].token_ids
    assert not llm.has_unfinished_requests()
    assert llm.scheduler.kv_cache_manager.num_free_blocks == llm.config.num_kvcache_blocks


def test_n_samples_finishing_at_different_times(llm):
    """A request is returned once, when its last sample finishes."""
    prompt = PROMPTS[0]
    first = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=2,
                                                stop_token_ids=[first.token_ids[0]]), use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs) == 4
    assert {c.finish_reason for c in out[0].outputs} <= {"stop", "length"}


def test_stop_reason(llm):
    prompt = "The quick brown fox"
    full = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24), use_tqdm=False)
    full = full[0].outputs[0]
    assert full.finish_reason == "length" and full.stop_reason is None
    stop = full.text[6:10]
    by_string = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, stop=["zzzz-never", stop]),
                             use_tqdm=False)[0].outputs[0]
    assert by_string.finish_reason == "stop" and by_string.stop_reason == stop
    assert by_string.text == full.text[:full.text.index(stop)]
    token = full.token_ids[3]
    by_token = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[token]),
                            use_tqdm=False)[0].outputs[0]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == token
    assert by_token.token_ids == full.token_ids[:full.token_ids.index(token) + 1]


def test_eos_gives_no_stop_reason(llm, qwen3_tiny_dir):
    """Ended by EOS: stop_reason None, even when EOS is also a stop token id (vLLM checks EOS first)."""
    prompt = PROMPTS[0]
    first = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    eos = first.token_ids[1]
    engine = LLM(qwen3_tiny_dir, eos_token_id=eos, **ENGINE_ARGS)  # the 2nd generated token is EOS here
    for stop_token_ids in ([], [eos]):
        out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=stop_token_ids),
                              use_tqdm=False)[0].outputs[0]
        assert out.token_ids == first.token_ids[:first.token_ids.index(eos) + 1]
        assert out.finish_reason == "stop" and out.stop_reason is None


def test_prompt_dicts(llm):
    text = "hello there"
    params = SamplingParams(temperature=0.0, max_tokens=4)
    by_text = llm.generate(text, params, use_tqdm=False)[0]
    by_dict = llm.generate({"prompt": text}, params, use_tqdm=False)[0]
    by_ids = llm.generate({"prompt_token_ids": by_text.prompt_token_ids}, params, use_tqdm=False)[0]
    mixed = llm.generate([{"prompt": text}, by_text.prompt_token_ids, text], params, use_tqdm=False)
    assert by_dict.prompt == text and by_dict.prompt_token_ids == by_text.prompt_token_ids
    assert by_ids.prompt is None and by_ids.prompt_token_ids == by_text.prompt_token_ids
    assert by_dict.outputs[0].token_ids == by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    assert [o.outputs[0].token_ids for o in mixed] == [by_text.outputs[0].token_ids] * 3
    with pytest.raises(ValueError, match="'prompt' .* or 'prompt_token_ids'"):
        llm.generate({"text": text}, params, use_tqdm=False)
    with pytest.raises(TypeError, match="'prompt_token_ids' must be a list of ints"):
        llm.generate({"prompt_token_ids": "abc"}, params, use_tqdm=False)
    with pytest.raises(TypeError, match="a prompt must be"):
        llm.generate({"prompt_token_ids": [1, "b"]}, params, use_tqdm=False)
    assert llm.scheduler.is_finished()


def test_request_ids_are_strings(llm):
    engine_id = llm.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2))
    assert isinstance(engine_id, str)
    finished = []
    while llm.has_unfinished_requests():
        finished += [o for o in llm.step() if o.finished]  # (running CUMULATIVE requests report too)
    assert [o.request_id for o in finished] == [engine_id]


def test_get_tokenizer(llm, qwen3_tiny_dir):
    tokenizer = llm.get_tokenizer()
    reference = AutoTokenizer.from_pretrained(qwen3_tiny_dir)
    assert tokenizer.encode("a test", add_special_tokens=False) == reference.encode("a test", add_special_tokens=False)


@pytest.fixture(scope="module")
def model_without_tokenizer(qwen3_tiny_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("no-tokenizer") / "qwen3-tiny"
    shutil.copytree(qwen3_tiny_dir, path, ignore=shutil.ignore_patterns(*TOKENIZER_FILES))
    return str(path)


def test_skip_tokenizer_init(model_without_tokenizer, llm):
    engine = LLM(model_without_tokenizer, skip_tokenizer_init=True, **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1)
    out = engine.generate([PROMPTS[0], {"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)
    expected = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for got, want in zip(out, expected):
        assert got.prompt is None and got.outputs[0].text == ""
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert all(lp.decoded_token is None for p in got.outputs[0].logprobs for lp in p.values())
    stop_id = expected[0].outputs[0].token_ids[2]
    stopped = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[stop_id]),
                              use_tqdm=False)[0].outputs[0]
    assert stopped.stop_reason == stop_id
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        engine.generate("text", params, use_tqdm=False)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        engine.generate([PROMPTS[0]], SamplingParams(stop=["x"]), use_tqdm=False)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        engine.get_tokenizer()
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        engine.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)
    assert engine.scheduler.is_finished()


def test_tokenizer_from_another_directory(model_without_tokenizer, qwen3_tiny_dir, llm):
    with pytest.raises(ValueError, match="has no tokenizer files"):
        LLM(model_without_tokenizer, **ENGINE_ARGS)
    engine = LLM(model_without_tokenizer, tokenizer=qwen3_tiny_dir, **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    got = engine.generate("The quick brown fox", params, use_tqdm=False)[0]
    want = llm.generate("The quick brown fox", params, use_tqdm=False)[0]
    assert got.prompt_token_ids == want.prompt_token_ids and got.outputs[0].text == want.outputs[0].text
    with pytest.raises(ValueError, match="tokenizer must be a local tokenizer directory"):
        LLM(model_without_tokenizer, tokenizer="/nonexistent/tokenizer", **ENGINE_ARGS)


def test_async_scheduling_with_logprobs_penalties_and_n(qwen3_tiny_dir):
    """Placeholder tokens under async scheduling: penalties count the in-flight token from the
    device, and logprobs travel with the step's token copy."""
    params = [SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20, repetition_penalty=1.4, logprobs=2,
                             frequency_penalty=0.5),
              SamplingParams(temperature=0.9, max_tokens=15, seed=4, n=2, presence_penalty=1.0, logprobs=0),
              SamplingParams(temperature=0.0, max_tokens=9, prompt_logprobs=1)]
    results = {}
    for async_scheduling in (False, True):
        engine = LLM(qwen3_tiny_dir, async_scheduling=async_scheduling, **ENGINE_ARGS)
        results[async_scheduling] = engine.generate(PROMPTS, params, use_tqdm=False)
        assert engine.scheduler.kv_cache_manager.num_free_blocks == engine.config.num_kvcache_blocks
    for sync, overlapped in zip(results[False], results[True]):
        assert [c.token_ids for c in overlapped.outputs] == [c.token_ids for c in sync.outputs]
        # Different batches may round the last bits differently: logprobs agree closely, ranks exactly.
        for got, want in zip(overlapped.outputs, sync.outputs):
            assert (got.cumulative_logprob is None) == (want.cumulative_logprob is None)
            if want.logprobs is not None:
                assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-4)
                assert_same_logprobs(got.logprobs, want.logprobs)
        if sync.prompt_logprobs is not None:
            assert_same_logprobs(overlapped.prompt_logprobs[1:], sync.prompt_logprobs[1:])
    assert results[True][2].prompt_logprobs is not None and results[True][1].outputs[0].logprobs is not None


def assert_same_logprobs(got, want):
    """Two lists of {token: Logprob}: the same tokens and ranks, logprobs within float noise."""
    assert [[(t, lp.rank) for t, lp in p.items()] for p in got] == [[(t, lp.rank) for t, lp in p.items()] for p in want]
    flat = [[lp.logprob for p in positions for lp in p.values()] for positions in (got, want)]
    assert flat[0] == pytest.approx(flat[1], abs=1e-5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(n=0), r"n must be an int >= 1"), (dict(n=2.0), r"n must be an int >= 1"),
    (dict(logprobs=-1), rf"logprobs must be None or an int in \[0, {MAX_LOGPROBS}\]"),
    (dict(logprobs=MAX_LOGPROBS + 1), r"logprobs must be None or an int"),
    (dict(logprobs=True), r"logprobs must be None or an int"),
    (dict(prompt_logprobs=1.5), r"prompt_logprobs must be None or an int"),
    (dict(presence_penalty=2.5), r"presence_penalty must be a number in \[-2, 2\]"),
    (dict(frequency_penalty=-3), r"frequency_penalty must be a number in \[-2, 2\]"),
    (dict(frequency_penalty=float("nan")), r"frequency_penalty must be a number"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be a number > 0"),
    (dict(repetition_penalty=-1.0), r"repetition_penalty must be a number > 0"),
    (dict(repetition_penalty=math.inf), r"repetition_penalty must be a number > 0"),
])
def test_new_fields_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_new_fields_accept_their_ranges():
    params = SamplingParams(n=3, logprobs=0, prompt_logprobs=MAX_LOGPROBS, presence_penalty=-2, frequency_penalty=2,
                            repetition_penalty=0.01)
    assert (params.n, params.logprobs, params.prompt_logprobs) == (3, 0, MAX_LOGPROBS)
    assert params.uses_penalties and not SamplingParams().uses_penalties
