"""The engine end to end on CPU (float32, torch attention): exact parity with transformers' greedy
generate, prefix caching, preemption, sampling reproducibility, stop strings and bad inputs.

Every engine here is pinned to the CPU (also on a CUDA machine): token-for-token parity needs
float32 on both sides. tests/test_gpu_engine.py covers the engine on the GPU."""
import random

import pytest
import torch
from hf_reference import hf_greedy
from transformers import AutoModelForCausalLM

from conftest_kernels import needs_interpreter
from minivllm import LLM, SamplingParams

NUM_NEW_TOKENS = 32
ENGINE_ARGS = dict(device="cpu", max_model_len=512, max_num_batched_tokens=2048, max_num_seqs=16, kvcache_block_size=16)


def random_prompts(num, min_len, max_len, vocab, seed=0):
    rng = random.Random(seed)
    lengths = [min_len, max_len] + [rng.randint(min_len, max_len) for _ in range(num - 2)]
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def greedy(max_tokens=NUM_NEW_TOKENS, **kwargs):
    # min_tokens = max_tokens bans EOS as transformers' min_new_tokens does, so both run to the end.
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, **kwargs)


@pytest.fixture(scope="module")
def qwen3_llm(qwen3_tiny_dir):
    with LLM(qwen3_tiny_dir, **ENGINE_ARGS) as llm:
        yield llm


@pytest.mark.parametrize("model_fixture", ["qwen3_tiny_dir", "llama_tiny_dir"])
def test_greedy_matches_transformers(request, model_fixture):
    model_dir = request.getfixturevalue(model_fixture)
    llm = LLM(model_dir, **ENGINE_ARGS)
    prompts = random_prompts(8, 1, 200, llm.config.hf_config.vocab_size)
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    expected = hf_greedy(model_dir, prompts, NUM_NEW_TOKENS)
    for prompt, out, ref in zip(prompts, outputs, expected):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == ref, f"prompt of {len(prompt)} tokens diverged"
        assert out.outputs[0].finish_reason == "length" and out.finished


def test_prefix_caching_same_outputs_and_hits(qwen3_tiny_dir):
    vocab = 1000
    shared = random_prompts(1, 100, 100, vocab, seed=1)[0]
    prompts = [shared + tail for tail in random_prompts(4, 3, 30, vocab, seed=2)]
    results = {}
    for caching in (False, True):
        llm = LLM(qwen3_tiny_dir, enable_prefix_caching=caching, **ENGINE_ARGS)
        first = llm.generate(prompts[:1], greedy(8), use_tqdm=False)
        rest = llm.generate(prompts[1:], greedy(8), use_tqdm=False)
        results[caching] = [o.outputs[0].token_ids for o in first + rest]
        hits = llm.stats.num_cached_prompt_tokens
        if caching:  # 100 shared tokens = 6 full blocks of 16 for each of the 3 later prompts
            assert hits == 3 * 96 and [o.num_cached_tokens for o in rest] == [96, 96, 96]
            assert llm.reset_prefix_cache()  # then the same prompt hits nothing
            again = llm.generate(prompts[1:2], greedy(8), use_tqdm=False)[0]
            assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == rest[0].outputs[0].token_ids
        else:
            assert hits == 0
    assert results[True] == results[False]


def test_preemption_gives_same_outputs_and_frees_every_block(qwen3_tiny_dir):
    prompts = random_prompts(6, 20, 60, 1000, seed=3)
    big = LLM(qwen3_tiny_dir, **ENGINE_ARGS)
    expected = [o.outputs[0].token_ids for o in big.generate(prompts, greedy(40), use_tqdm=False)]
    # A sequence grows to at most 60 + 40 tokens = 13 blocks of 8; 14 blocks cannot hold all six at once.
    small = LLM(qwen3_tiny_dir, **{**ENGINE_ARGS, "max_model_len": 104, "kvcache_block_size": 8,
                                   "num_kvcache_blocks": 14})
    outputs = small.generate(prompts, greedy(40), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert small.scheduler.num_preemptions > 0
    manager = small.scheduler.kv_cache_manager
    assert manager.num_free_blocks == 14
    assert all(block.ref_count == 0 for block in manager.pool.blocks.values())


def test_seeded_sampling_reproducible_regardless_of_batch(qwen3_llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    alone = qwen3_llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = qwen3_llm.generate([[9] * 20, [5, 6, 7], [3] * 40], [others, params, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


def test_stop_string_is_honoured_and_cut(qwen3_llm):
    prompt = "The quick brown fox"
    full = qwen3_llm.generate(prompt, greedy(24), use_tqdm=False)[0].outputs[0].text
    assert len(full) > 12
    stop = full[6:10]
    out = qwen3_llm.generate(prompt, greedy(24, stop=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == full[:full.index(stop)]
    assert stop not in out.outputs[0].text


def test_stop_token_ids_and_eos(qwen3_tiny_dir, qwen3_llm):
    """A stop token id, or EOS, ends the output right after its first occurrence. Seeded sampling
    gives varied tokens (greedy outputs of the random tiny model repeat one token); the stop token
    is one that first appears late, so that stopping early, late or at the first token shows."""
    prompt = random_prompts(1, 12, 12, 1000, seed=11)[0]

    def run(llm, **kwargs):
        params = SamplingParams(temperature=1.0, seed=5, max_tokens=10, **kwargs)
        return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]

    full = run(qwen3_llm, ignore_eos=True).token_ids
    k = max(i for i in range(3, len(full) - 2) if full[i] not in full[:i])
    stop = full[k]
    out = run(qwen3_llm, ignore_eos=True, stop_token_ids=[stop])
    assert out.token_ids == full[:k + 1] and out.finish_reason == "stop"
    out = run(qwen3_llm, ignore_eos=True, stop_token_ids=[stop], min_tokens=k + 2)  # banned until then
    assert out.token_ids[:k] == full[:k] and stop not in out.token_ids[:k + 2] and len(out.token_ids) >= k + 2
    eos = LLM(qwen3_tiny_dir, eos_token_id=stop, **ENGINE_ARGS)
    out = run(eos)
    assert out.token_ids == full[:k + 1] and out.finish_reason == "stop"
    out = run(eos, ignore_eos=True)
    assert out.token_ids == full and out.finish_reason == "length"


def test_prompt_forms_and_order(qwen3_llm):
    one = qwen3_llm.generate("hello", greedy(4), use_tqdm=False)
    ids = qwen3_llm.generate([1, 2, 3], greedy(4), use_tqdm=False)
    mixed = qwen3_llm.generate(["hello", [1, 2, 3]], [greedy(4), greedy(5)], use_tqdm=False)
    assert len(one) == 1 and one[0].prompt == "hello"
    assert ids[0].prompt is None and ids[0].prompt_token_ids == [1, 2, 3]
    assert mixed[0].outputs[0].token_ids == one[0].outputs[0].token_ids
    assert mixed[1].outputs[0].token_ids[:4] == ids[0].outputs[0].token_ids
    assert len(mixed[1].outputs[0].token_ids) == 5


def test_chat_applies_template(qwen3_llm):
    conversation = [{"role": "user", "content": "Hi there"}]
    out = qwen3_llm.chat(conversation, greedy(4), use_tqdm=False)[0]
    assert out.prompt.startswith("<|im_start|>user\nHi there<|im_end|>\n") and out.prompt.endswith("<|im_start|>assistant\n")
    assert len(qwen3_llm.chat([conversation, conversation], greedy(2), use_tqdm=False)) == 2


def test_bad_inputs_raise_and_engine_stays_usable(qwen3_tiny_dir):
    """Errors before scheduling (bad prompts, bad parameters) and in the middle of a generate (the
    sampler raises at the third step) leave nothing queued, every block free, and the next call's
    output equal to a fresh engine's. Every bad-input case: test_bad_inputs.py; faults: test_faults.py."""
    llm = LLM(qwen3_tiny_dir, **ENGINE_ARGS)
    prompts = random_prompts(4, 5, 40, 1000, seed=12)
    bad_params = greedy(4)
    bad_params.max_tokens = 0  # SamplingParams is mutable: checked again when the request is added
    with pytest.raises(ValueError, match="prompt 2: the prompt has 513 tokens, more than max_model_len=512"):
        llm.generate(prompts[:2] + [[7] * 513], greedy(4), use_tqdm=False)
    with pytest.raises(TypeError, match="prompt 1: sampling_params must be a SamplingParams, got dict"):
        llm.generate(prompts[:2], [greedy(4), {"temperature": 0.0}], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 1: max_tokens must be an int >= 1, got 0"):
        llm.generate(prompts[:2], [greedy(4), bad_params], use_tqdm=False)
    assert not llm.has_unfinished_requests()  # no orphan request from the calls that failed

    sample = llm.model_runner.sample
    calls = []

    def failing_sample(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("sampler failed")
        return sample(*args)

    llm.model_runner.sample = failing_sample
    with pytest.raises(RuntimeError, match="sampler failed"):
        llm.generate(prompts, greedy(8), use_tqdm=False)
    del llm.model_runner.sample
    manager = llm.scheduler.kv_cache_manager
    assert not llm.has_unfinished_requests() and manager.num_free_blocks == manager.num_blocks

    fresh = LLM(qwen3_tiny_dir, **ENGINE_ARGS)
    expected = [o.outputs[0].token_ids for o in fresh.generate(prompts, greedy(8), use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(8), use_tqdm=False)] == expected


def test_smollm2_chat_matches_transformers_and_knows_paris(smollm2_dir):
    """The demo's questions and settings: its wrong answers (a 135M model) are transformers' too."""
    from minivllm.demo import QUESTIONS, SMOLLM2_MAX_TOKENS

    llm = LLM(str(smollm2_dir), device="cpu", max_model_len=512, max_num_batched_tokens=2048, max_num_seqs=8)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outputs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=SMOLLM2_MAX_TOKENS), use_tqdm=False)
    prompts = [o.prompt_token_ids for o in outputs]
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=SMOLLM2_MAX_TOKENS, do_sample=False)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref
    assert QUESTIONS[0] == "What is the capital of France?"
    assert outputs[0].outputs[0].text == "The capital of France is Paris."
    assert outputs[0].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_smollm2_knows_paris_in_half_precision(smollm2_dir, dtype):
    """The demo's first question at the GPU's precision, on the CPU. "The" leads "L" by 0.09 in
    float32; logits rounded to bfloat16 were both 25.5 and greedy answered "L'Étoile, ..." (the LM
    head now stores float32 logits)."""
    with LLM(str(smollm2_dir), device="cpu", dtype=dtype, max_model_len=256, max_num_batched_tokens=256,
             max_num_seqs=1) as llm:
        outputs = llm.chat([[{"role": "user", "content": "What is the capital of France?"}]],
                           SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    assert outputs[0].outputs[0].text == "The capital of France is Paris."


@needs_interpreter
def test_triton_backend_matches_torch_backend_on_cpu(tmp_path):
    """The engine with the Triton kernels (interpreter on CPU): prefill, prefix-hit prefill, decode."""
    from minivllm.tools.make_model import make_model

    tiny = make_model({"preset": "qwen3-tiny", "num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256,
                       "num_attention_heads": 4, "num_key_value_heads": 2}, tmp_path / "m")
    shared = list(range(40, 76))  # 36 tokens: two full blocks of 16 hit the prefix cache the second time
    prompts = [shared + [3, 4], shared + [5], [9] * 5, [1]]
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny), attention_backend=backend, **{**ENGINE_ARGS, "max_model_len": 128})
        first = llm.generate(prompts[:1], greedy(6), use_tqdm=False)
        rest = llm.generate(prompts[1:], greedy(6), use_tqdm=False)
        assert rest[0].num_cached_tokens == 32
        outputs[backend] = [o.outputs[0].token_ids for o in first + rest]
    assert outputs["triton"] == outputs["torch"]


@pytest.mark.parametrize("scenario", ["plain", "preemption", "stops_and_seeds", "prefill_chain"])
def test_async_scheduling_gives_the_same_outputs(qwen3_tiny_dir, scenario):
    """Scheduling step N+1 before step N's tokens reach the host (placeholders, device-side input
    ids, discarded rows of sequences that just finished) changes nothing in what is generated."""
    prompts = random_prompts(7, 5, 60, 1000, seed=7)
    args = dict(ENGINE_ARGS)
    params = [greedy(n) for n in (3, 9, 17, 30, 12, 5, 25)]
    if scenario == "preemption":
        args.update(max_model_len=104, kvcache_block_size=8, num_kvcache_blocks=16)
        params = [greedy(40) for _ in prompts]
    if scenario == "stops_and_seeds":
        params = [SamplingParams(temperature=0.9, max_tokens=20, seed=i, stop_token_ids=[i * 11],
                                 min_tokens=2 * (i % 3)) for i in range(len(prompts))]
    if scenario == "prefill_chain":  # one prompt per prefill step, queued behind each other; later
        # prompts hit blocks an in-flight prefill is still writing; max_tokens=1 finishes at prefill
        shared = random_prompts(1, 40, 40, 1000, seed=8)[0]
        prompts = [shared + p for p in prompts]
        args.update(max_num_batched_tokens=128, max_model_len=128)
        params = [greedy(n) for n in (1, 9, 1, 30, 12, 1, 25)]
    results = {}
    for async_scheduling in (False, True):
        llm = LLM(qwen3_tiny_dir, async_scheduling=async_scheduling, **args)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results[async_scheduling] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs]
        assert llm.scheduler.kv_cache_manager.num_free_blocks == llm.config.num_kvcache_blocks
        assert not llm.has_unfinished_requests()
        if scenario == "preemption":
            assert llm.scheduler.num_preemptions > 0
    assert results[True] == results[False]


def test_shutdown_and_context_manager(qwen3_tiny_dir):
    with LLM(qwen3_tiny_dir, **ENGINE_ARGS) as llm:
        runner = llm.model_runner
        assert llm.generate([[1, 2, 3]], greedy(3), use_tqdm=False)[0].outputs[0].token_ids
    assert llm.model_runner is None and runner.model is None and runner.kv_cache is None
    llm.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="has been shut down"):
        llm.generate([[1, 2, 3]], greedy(3), use_tqdm=False)


def test_prompt_graph_sizes():
    """The token buckets of the prompt-step graphs: powers of two from 16, 1.5x steps from 256 on."""
    from minivllm.engine.prompt_graphs import prompt_graph_sizes

    assert prompt_graph_sizes(4096) == [16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096]
    assert prompt_graph_sizes(512) == [16, 32, 64, 128, 256, 384, 512]
    assert prompt_graph_sizes(1000) == [16, 32, 64, 128, 256, 384, 512, 768]
    assert prompt_graph_sizes(15) == []
