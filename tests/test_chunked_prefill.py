"""Chunked prefill end to end on CPU: the same tokens with it on and off.

Prompts longer than the token budget are split across steps and share steps with decodes; prefix
cache hits end mid-chunk and chunks end mid-block; preemption hits sequences mid-prefill; stop
strings and seeded sampling see the same tokens; the async path too; the Triton kernels (under
the interpreter) as well as the torch references.
"""
import random

import pytest
from conftest_kernels import needs_interpreter

from minivllm import LLM, SamplingParams

# On the CPU in float32 (also on a CUDA machine): the tokens must match exactly.
ENGINE_ARGS = dict(device="cpu", max_model_len=256, max_num_seqs=8, kvcache_block_size=16)
CHUNKED = dict(enable_chunked_prefill=True, max_num_batched_tokens=24)  # 24: chunk ends fall mid-block
UNCHUNKED = dict(enable_chunked_prefill=False, max_num_batched_tokens=256)


def random_prompts(lengths, vocab=1000, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def greedy(max_tokens, **kwargs):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, **kwargs)


def generate_in_two_rounds(llm, prompts, params):
    """The first prompt alone, then the rest (which hit its cached prefix), as one list of outputs."""
    first = llm.generate(prompts[:1], params[:1], use_tqdm=False)
    return first + llm.generate(prompts[1:], params[1:], use_tqdm=False)


def summary(outputs):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outputs]


@pytest.fixture(scope="module")
def workload():
    """Long prompts (more than the budget), short ones, and prompts that share the first prompt's
    first 40 tokens: 32 of them (two blocks) come from the prefix cache, a prefix ending mid-chunk
    of the 24-token chunks that first computed it."""
    shared = random_prompts([40], seed=1)[0]
    tails = random_prompts([30, 3, 61], seed=2)
    prompts = [shared + tails[0]] + random_prompts([70, 5, 1, 100], seed=3) + [shared + t for t in tails[1:]]
    params = [greedy(12) for _ in prompts]
    params[2] = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=7, ignore_eos=True)
    params[4] = SamplingParams(temperature=1.0, max_tokens=10, seed=11, ignore_eos=True)
    return prompts, params


def test_chunked_prefill_gives_the_same_outputs(qwen3_tiny_dir, workload):
    prompts, params = workload
    reference_llm = LLM(qwen3_tiny_dir, **ENGINE_ARGS, **UNCHUNKED)
    reference = generate_in_two_rounds(reference_llm, prompts, params)
    # A stop string cut from the reference's own text: the runs must stop at the same place.
    text = reference[1].outputs[0].text
    params = list(params)
    params[1] = greedy(12, stop=[text[len(text) // 2:len(text) // 2 + 3]])
    reference = summary(generate_in_two_rounds(reference_llm, prompts, params))
    assert reference[1][1] == "stop"
    for async_scheduling in (False, True):
        llm = LLM(qwen3_tiny_dir, async_scheduling=async_scheduling, **ENGINE_ARGS, **CHUNKED)
        steps = record_steps(llm)
        outputs = generate_in_two_rounds(llm, prompts, params)
        assert summary(outputs) == reference, f"async_scheduling={async_scheduling}"
        assert [o.num_cached_tokens for o in outputs[-2:]] == [32, 32]
        assert max(n for n, _ in steps) <= 24
        assert any(0 < num_decodes < num_seqs for _, (num_decodes, num_seqs) in steps), "no mixed step"
        assert llm.scheduler.kv_cache_manager.num_free_blocks == llm.config.num_kvcache_blocks


def record_steps(llm):
    """Record (num_batched_tokens, (num_decodes, num_seqs)) of every scheduled step."""
    steps, schedule, schedule_prefills = [], llm.scheduler.schedule, llm.scheduler.schedule_prefills

    def recorded(fn):
        def wrapper():
            out = fn()
            steps.append((out.num_batched_tokens, (out.num_decodes, len(out.seqs))))
            return out
        return wrapper
    llm.scheduler.schedule, llm.scheduler.schedule_prefills = recorded(schedule), recorded(schedule_prefills)
    return steps


def test_preemption_mid_prefill_gives_the_same_outputs(qwen3_tiny_dir):
    prompts = random_prompts([20, 20, 20, 60, 60], seed=4)
    params = greedy(40)
    expected = [o.outputs[0].token_ids for o in
                LLM(qwen3_tiny_dir, **ENGINE_ARGS, **UNCHUNKED).generate(prompts, params, use_tqdm=False)]
    # 18 blocks of 8 tokens: the three short sequences decode while a 60-token prompt is prefilled
    # in chunks beside them, and run out of blocks before it is done.
    small = LLM(qwen3_tiny_dir, device="cpu", max_model_len=104, kvcache_block_size=8, num_kvcache_blocks=18,
                max_num_seqs=8, enable_chunked_prefill=True, max_num_batched_tokens=16)
    preempted_mid_prefill = []
    preempt = small.scheduler.preempt

    def recording_preempt(seq):
        preempted_mid_prefill.append(seq.is_prefilling)
        preempt(seq)
    small.scheduler.preempt = recording_preempt
    outputs = small.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert any(preempted_mid_prefill), f"no preemption mid-prefill ({preempted_mid_prefill})"
    manager = small.scheduler.kv_cache_manager
    assert manager.num_free_blocks == 18 and all(block.ref_count == 0 for block in manager.pool.blocks.values())


def test_long_context_with_a_small_budget(qwen3_tiny_dir):
    """max_model_len above the budget is accepted only with chunked prefill."""
    with pytest.raises(ValueError, match="when chunked prefill is off"):
        LLM(qwen3_tiny_dir, device="cpu", max_model_len=256, max_num_batched_tokens=32, enable_chunked_prefill=False)
    llm = LLM(qwen3_tiny_dir, device="cpu", max_model_len=256, max_num_batched_tokens=32, max_num_seqs=4)
    steps = record_steps(llm)
    out = llm.generate([list(range(1, 201))], greedy(3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    assert [n for n, _ in steps][:7] == [32] * 6 + [200 - 6 * 32]  # the prompt in 7 chunks


@needs_interpreter
def test_triton_backend_chunks_match_unchunked(tmp_path):
    """The Triton kernels (interpreter on CPU): prompt chunks over paged prefixes, mixed steps
    (small ones: decode rows as 1-token chunks; tests/test_mixed_attention.py runs both ways),
    prefix hits ending mid-chunk."""
    from minivllm.tools.make_model import make_model

    tiny = make_model({"preset": "qwen3-tiny", "num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256,
                       "num_attention_heads": 4, "num_key_value_heads": 2}, tmp_path / "m")
    shared = random_prompts([36], seed=5)[0]
    prompts = [shared + [3, 4], random_prompts([45], seed=6)[0], [9] * 5, shared + [5, 6, 7]]
    params = [greedy(5) for _ in prompts]
    outputs = {}
    # (the Triton backend without chunks matches torch: tests/test_engine.py)
    for name, backend, args in (("torch", "torch", UNCHUNKED),
                                ("triton chunked", "triton", dict(CHUNKED, max_num_batched_tokens=20))):
        llm = LLM(str(tiny), attention_backend=backend, **{**ENGINE_ARGS, "max_model_len": 128, **args})
        result = generate_in_two_rounds(llm, prompts, params)
        assert result[-1].num_cached_tokens == 32
        outputs[name] = [o.outputs[0].token_ids for o in result]
    assert outputs["triton chunked"] == outputs["torch"]


def test_logprobs_penalties_and_n_with_chunks(qwen3_tiny_dir):
    """Prompt logprobs gathered chunk by chunk (a prompt of budget + 1 tokens ends on a one-token
    chunk), sample logprobs, penalties and n > 1: the same with chunked prefill on and off."""
    prompts = random_prompts([25, 16 + 1, 60, 4], seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=2, logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3, presence_penalty=0.5),
              SamplingParams(temperature=0.8, max_tokens=5, n=2, seed=3, logprobs=1)]
    results = {}
    for chunked, async_scheduling in ((False, False), (True, False), (True, True)):
        budget = dict(CHUNKED, max_num_batched_tokens=16) if chunked else UNCHUNKED
        llm = LLM(qwen3_tiny_dir, async_scheduling=async_scheduling, **ENGINE_ARGS, **budget)
        results[chunked, async_scheduling] = llm.generate(prompts, params, use_tqdm=False)
        # Alone, the 17-token prompt is a 16-token chunk, then its last token in a decode-only step.
        results[chunked, async_scheduling][1] = llm.generate(prompts[1:2], params[1:2], use_tqdm=False)[0]
    reference = results[False, False]
    assert [len(o.prompt_logprobs) for o in reference[:2]] == [25, 17]  # None, then one per prompt position
    for key, outputs in results.items():
        for got, want in zip(outputs, reference):
            assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs], key
            # Other batch shapes round the last bits differently: logprobs agree closely, ranks exactly.
            assert_same_logprobs(got.prompt_logprobs, want.prompt_logprobs)
            for a, b in zip(got.outputs, want.outputs):
                assert_same_logprobs(a.logprobs, b.logprobs)
                assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)


def assert_same_logprobs(got, want):
    """Lists of {token: Logprob} (or None): the same tokens and ranks, logprobs within float noise."""
    if want is None:
        assert got is None
        return
    assert len(got) == len(want) and [p is None for p in got] == [p is None for p in want]
    pairs = [(a, b) for a, b in zip(got, want) if b is not None]
    assert [[(t, lp.rank) for t, lp in a.items()] for a, _ in pairs] == [[(t, lp.rank) for t, lp in b.items()]
                                                                          for _, b in pairs]
    flat = [[lp.logprob for p in side for lp in p.values()] for side in zip(*pairs)] if pairs else [[], []]
    assert flat[0] == pytest.approx(flat[1], abs=1e-4)
