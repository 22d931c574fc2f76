"""The engine with an FP8 KV cache (kv_cache_dtype="fp8") on CPU: teacher-forced logits close to
the full-precision cache's, greedy tokens mostly the same, scales from the first prefill, 1 byte
per cached element in the sizing, the Triton kernels agreeing with the torch references, and clear
errors for what is not supported."""
import pytest
import torch

from conftest_kernels import needs_interpreter  # noqa: I001

from minivllm import LLM, SamplingParams
from minivllm.config import Config, check_fp8_supported

ENGINE_ARGS = dict(device="cpu", max_model_len=256, max_num_batched_tokens=1024, max_num_seqs=8, kvcache_block_size=16)
NUM_STEPS = 24


def _prompts(vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (n,), generator=gen).tolist() for n in (5, 37, 120)]


class TeacherForcingSampler:
    """Stands in for the runner's sampler: records each step's logits and returns the next token
    of a given continuation instead of sampling (one sequence at a time)."""

    def __init__(self, continuation):
        self.continuation = continuation
        self.logits = []

    def __call__(self, logits, tensors):
        step = len(self.logits)
        if step < len(self.continuation):  # (an overlapped engine may run one step past the end)
            self.logits.append(logits[0].float().clone())
        token = self.continuation[min(step, len(self.continuation) - 1)]
        return torch.tensor([token], dtype=torch.int64, device=logits.device)


def teacher_forced_logits(llm, prompt, continuation):
    """Logits at every step of generating `continuation` after `prompt`: [len(continuation), vocab]."""
    runner = llm.model_runner
    real_sampler, runner.sampler = runner.sampler, TeacherForcingSampler(continuation)
    try:
        n = len(continuation)
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n), use_tqdm=False)
        assert len(runner.sampler.logits) == n
        return torch.stack(runner.sampler.logits)
    finally:
        runner.sampler = real_sampler


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


@pytest.fixture(scope="module")
def reference(qwen3_tiny_dir):
    """The full-precision (float32) cache: prompts, their greedy continuations and logits."""
    with LLM(qwen3_tiny_dir, **ENGINE_ARGS) as llm:
        prompts = _prompts(llm.config.hf_config.vocab_size)
        outputs = llm.generate(prompts, greedy(NUM_STEPS), use_tqdm=False)
        continuations = [o.outputs[0].token_ids for o in outputs]
        logits = [teacher_forced_logits(llm, p, c) for p, c in zip(prompts, continuations)]
    return prompts, continuations, logits


@pytest.mark.parametrize("calculate_kv_scales", [True, False])
def test_fp8_cache_logits_close_and_greedy_tokens_mostly_equal(qwen3_tiny_dir, reference, calculate_kv_scales):
    prompts, continuations, ref_logits = reference
    with LLM(qwen3_tiny_dir, kv_cache_dtype="fp8", calculate_kv_scales=calculate_kv_scales, **ENGINE_ARGS) as llm:
        assert llm.model_runner.kv_cache.dtype == torch.float8_e4m3fn
        logits = [teacher_forced_logits(llm, p, c) for p, c in zip(prompts, continuations)]
        scales = llm.model_runner.kv_scales.clone()
        outputs = llm.generate(prompts, greedy(NUM_STEPS), use_tqdm=False)
    if calculate_kv_scales:
        assert (scales != 1.0).all() and (scales > 0).all()  # every layer's K and V scale was set
    else:
        assert (scales == 1.0).all()
    first = [o.outputs[0].token_ids[:8] == c[:8] for o, c in zip(outputs, continuations)]
    errors, agree = [], []
    for ours, ref in zip(logits, ref_logits):
        # The first step is the prefill, which attends to this step's K/V before they are quantized.
        torch.testing.assert_close(ours[0], ref[0], atol=1e-5, rtol=1e-5)
        errors.append(((ours[1:] - ref[1:]).norm(dim=-1) / ref[1:].norm(dim=-1)).max())
        agree.append((ours.argmax(-1) == ref.argmax(-1)).float().mean())
    print(f"\nFP8 KV (calculate_kv_scales={calculate_kv_scales}): relative logit error per step up to "
          f"{[f'{e:.4f}' for e in errors]}, argmax agreement {[f'{a:.2f}' for a in agree]}, greedy first 8 equal {first}")
    assert max(errors) < 0.05, f"relative logit error per step up to {max(errors):.3f}"
    assert min(agree) >= 0.9, f"teacher-forced argmax agreement {[f'{a:.2f}' for a in agree]}"
    assert sum(first) >= 2, "greedy: the first 8 tokens differ for most prompts"


def test_fp8_cache_counts_one_byte_per_element(qwen3_tiny_dir):
    from minivllm.models.transformer import head_dim_of

    hf = Config(qwen3_tiny_dir, device="cpu").hf_config
    fp32_block_bytes = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim_of(hf) * 16 * 4
    args = dict(ENGINE_ARGS, cpu_kvcache_space_bytes=20 * fp32_block_bytes)  # the budget, not the need, binds
    with LLM(qwen3_tiny_dir, **args) as full, LLM(qwen3_tiny_dir, kv_cache_dtype="fp8_e4m3", **args) as fp8:
        full_bytes, fp8_bytes = full.model_runner.kv_cache_block_bytes(), fp8.model_runner.kv_cache_block_bytes()
        assert full_bytes == 4 * fp8_bytes == fp32_block_bytes  # float32 on the CPU vs 1 byte
        assert full.config.num_kvcache_blocks == 20
        assert fp8.config.num_kvcache_blocks == 4 * full.config.num_kvcache_blocks
        kv = fp8.model_runner.kv_cache
        assert kv.numel() * kv.element_size() == fp8.config.num_kvcache_blocks * fp8_bytes


@needs_interpreter
def test_triton_kernels_match_torch_references_with_fp8_cache(tmp_path):
    """Fused store, decode and prefix-hit prefill in the interpreter, all reading/writing FP8."""
    from minivllm.tools.make_model import make_model

    tiny = make_model({"preset": "qwen3-tiny", "num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256,
                       "num_attention_heads": 4, "num_key_value_heads": 2}, tmp_path / "m")
    shared = list(range(40, 76))  # 36 tokens: two full blocks hit the prefix cache the second time
    prompts = [shared + [3, 4], shared + [5], [9] * 5]
    outputs = {}
    for backend in ("torch", "triton"):
        with LLM(str(tiny), attention_backend=backend, kv_cache_dtype="fp8", calculate_kv_scales=True,
                 **{**ENGINE_ARGS, "max_model_len": 128}) as llm:
            first = llm.generate(prompts[:1], greedy(6), use_tqdm=False)
            rest = llm.generate(prompts[1:], greedy(6), use_tqdm=False)
            assert rest[0].num_cached_tokens == 32
            outputs[backend] = ([o.outputs[0].token_ids for o in first + rest], llm.model_runner.kv_scales.clone())
    assert outputs["triton"][0] == outputs["torch"][0]
    torch.testing.assert_close(outputs["triton"][1], outputs["torch"][1])


def test_bad_kv_cache_arguments(qwen3_tiny_dir, monkeypatch):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        Config(qwen3_tiny_dir, kv_cache_dtype="fp8_e5m2", device="cpu")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        Config(qwen3_tiny_dir, kv_cache_dtype="int8", device="cpu")
    with pytest.raises(ValueError, match="needs an FP8 KV cache"):
        Config(qwen3_tiny_dir, calculate_kv_scales=True, device="cpu")
    # A GPU older than Ada/Hopper (compute capability < 8.9) has no FP8: refused, not emulated.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (a stand-in device: only the check runs)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"FP8 support \(compute capability >= 8.9\); NVIDIA A100 has 8.0"):
        check_fp8_supported(torch.device("cuda"))
    with pytest.raises(ValueError, match="compute capability"):
        Config(qwen3_tiny_dir, kv_cache_dtype="fp8", device="cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_supported(torch.device("cuda"))  # an H100/H200: fine
    assert Config(qwen3_tiny_dir, kv_cache_dtype="fp8", device="cuda").kv_cache_torch_dtype == torch.float8_e4m3fn
    # Chunked prefill: on by default on both devices; either can be turned off.
    assert Config(qwen3_tiny_dir, device="cuda").enable_chunked_prefill is True
    assert Config(qwen3_tiny_dir, enable_chunked_prefill=False, device="cuda").enable_chunked_prefill is False
    assert Config(qwen3_tiny_dir, device="cpu").enable_chunked_prefill is True


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_smollm2_answers_the_demo_questions_alike_with_fp8_cache(smollm2_dir, device):
    """Real weights, the demo's questions, greedy, FP8 cache (scales 1.0) vs the model's dtype (float32
    on the CPU, bfloat16 with CUDA graphs on the GPU): the same first tokens, the same answer to the
    first question. (Free-running answers part later: K errors of a few percent move the scores
    through the softmax; measured prefix agreement on the CPU was 8, 6, 5, 15, 11 tokens.
    calculate_kv_scales=True did no better on this model.)"""
    from minivllm.demo import QUESTIONS

    answers = {}
    for kv_cache_dtype in ("auto", "fp8"):
        with LLM(str(smollm2_dir), kv_cache_dtype=kv_cache_dtype, device=device, max_model_len=512,
                 max_num_batched_tokens=2048, max_num_seqs=8, gpu_memory_utilization=0.3) as llm:
            outputs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                               SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
            answers[kv_cache_dtype] = [(o.outputs[0].text, o.outputs[0].token_ids) for o in outputs]
    agreement = [next((i for i, (a, b) in enumerate(zip(f, r)) if a != b), len(r))
                 for (_, f), (_, r) in zip(answers["fp8"], answers["auto"])]
    print(f"\n{device}: greedy tokens equal before the first difference, per question: {agreement}")
    assert answers["fp8"][0][0] == answers["auto"][0][0] == "The capital of France is Paris."
    for (_, fp8_ids), (_, ref_ids) in zip(answers["fp8"], answers["auto"]):
        assert fp8_ids[:4] == ref_ids[:4]


# ---- the GPU: Qwen3-0.6B-shaped (random weights), bf16 vs FP8 cache, Triton kernels, CUDA graphs ----

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.whole_gpu  # compares two caches sized from memory: other workers' allocations move them
@pytest.mark.parametrize("calculate_kv_scales", [True, False])
def test_fp8_cache_on_gpu_close_to_bf16(calculate_kv_scales):
    import random

    from minivllm.tools.make_model import make_model
    from minivllm.tools.tokenizer import minivllm_cache_dir

    model = str(make_model("qwen3-0.6b", minivllm_cache_dir() / "random-qwen3-0.6b", seed=0))
    rng = random.Random(0)
    prompts = [[rng.randrange(10000) for _ in range(rng.randint(1, 700))] for _ in range(16)]
    args = dict(dtype="bfloat16", max_model_len=2048, max_num_batched_tokens=8192, max_num_seqs=64,
                gpu_memory_utilization=0.4)
    results = {}
    for kv_cache_dtype in ("auto", "fp8"):
        with LLM(model, kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=calculate_kv_scales and kv_cache_dtype == "fp8",
                 **args) as llm:
            if kv_cache_dtype == "auto":
                continuations = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(16), use_tqdm=False)]
            logits = [teacher_forced_logits(llm, p, c) for p, c in zip(prompts, continuations)]
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(16), use_tqdm=False)]
            results[kv_cache_dtype] = (logits, tokens, llm.config.num_kvcache_blocks)
    (ref_logits, ref_tokens, ref_blocks), (logits, tokens, blocks) = results["auto"], results["fp8"]
    errors = [((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item() for a, b in zip(logits, ref_logits)]
    agree = [(a.argmax(-1) == b.argmax(-1)).float().mean().item() for a, b in zip(logits, ref_logits)]
    first = sum(a[:4] == b[:4] for a, b in zip(tokens, ref_tokens))
    print(f"\nFP8 KV on GPU (calculate_kv_scales={calculate_kv_scales}): blocks {blocks} vs {ref_blocks}; relative "
          f"logit error up to {max(errors):.4f} (mean {sum(errors) / len(errors):.4f}); teacher-forced argmax "
          f"agreement {sum(agree) / len(agree):.3f}; greedy first 4 tokens equal for {first}/{len(prompts)}")
    assert blocks > 1.9 * ref_blocks  # 1 byte per element instead of 2
    assert max(errors) < 0.1 and sum(agree) / len(agree) >= 0.9
    assert first >= 0.75 * len(prompts)
