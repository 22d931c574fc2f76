"""The engine with an FP8 KV cache (kv_cache_dtype="fp8") on CPU: teacher-forced logits close to
the full-precision cache's, greedy tokens mostly the same, scales from the first prefill, 1 byte
per cached element in the sizing, the Triton kernels agreeing with the torch references, and clear
errors for what is not supported."""
import pytest
import torch

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
        self.tokens = iter(continuation)
        self.logits = []

    def sample(self, logits, tensors):
        self.logits.append(logits[0].float().clone())
        return torch.tensor([next(self.tokens)], dtype=torch.int64, device=logits.device)


def teacher_forced_logits(llm, prompt, continuation):
    """Logits at every step of generating `continuation` after `prompt`: [len(continuation), vocab]."""
    runner = llm.model_runner
    real_sampler, runner.sampler = runner.sampler, TeacherForcingSampler(continuation)
    try:
        n = len(continuation)
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n), use_tqdm=False)
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
    with LLM(qwen3_tiny_dir, **ENGINE_ARGS) as full, LLM(qwen3_tiny_dir, kv_cache_dtype="fp8_e4m3", **ENGINE_ARGS) as fp8:
        full_bytes, fp8_bytes = full.model_runner.kv_cache_block_bytes(), fp8.model_runner.kv_cache_block_bytes()
        assert full_bytes == 4 * fp8_bytes  # float32 on the CPU vs 1 byte
        assert fp8.config.num_kvcache_blocks == 4 * full.config.num_kvcache_blocks
        kv = fp8.model_runner.kv_cache
        assert kv.numel() * kv.element_size() == fp8.config.num_kvcache_blocks * fp8_bytes


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
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"FP8 support \(compute capability >= 8.9\); NVIDIA A100 has 8.0"):
        check_fp8_supported(torch.device("cuda"))
    with pytest.raises(ValueError, match="compute capability"):
        Config(qwen3_tiny_dir, kv_cache_dtype="fp8", device="cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_supported(torch.device("cuda"))  # an H100/H200: fine
