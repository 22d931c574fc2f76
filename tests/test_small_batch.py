"""Small-batch GEMVs in the engine (minivllm/engine/small_batch.py): the same greedy tokens with the layer
on and off, its GEMVs taking the decode steps (norms and SiLU in their prologues) and the prefills
left to the model's own forward; a mixture-of-experts model folds only the norm into QKV; FP8 weights
keep their GEMMs; the option needs a GPU or Triton's interpreter."""
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.engine import small_batch
from minivllm.tools.make_model import make_model

DEFAULT_MAX_TOKENS = small_batch.MAX_TOKENS  # (before any test sets it)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ARGS = dict(device=DEVICE, dtype="float32", max_model_len=128, enforce_eager=True)
# Decode steps of a request asking for 8 tokens (the prefill makes the first): 7, and one more with async
# scheduling (on by default on CUDA), which schedules the step after the last token while that one runs.
DECODE_STEPS = 7 + (DEVICE == "cuda")


def prompts(num, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 400, (int(n),), generator=generator).tolist()
            for n in torch.randint(20, 30, (num,), generator=generator)]  # prefills of > 16 tokens


def tokens(llm, prompt_ids):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate([dict(prompt_token_ids=p) for p in prompt_ids], params)]


@pytest.fixture
def gemv_calls(monkeypatch):
    """The prologue of every GEMV the layer launches, and the row count it ran on. The layer takes steps
    of up to 16 tokens here, the kernel's most, so that steps of several rows go through it too (the
    default, MAX_TOKENS, is where it pays on a GPU: test_by_default_only_single_token_steps_take_the_gemvs)."""
    monkeypatch.setattr(small_batch, "MAX_TOKENS", 16)
    calls = Counter()

    def counted(x, *args, prologue="none", **kwargs):
        calls[prologue, x.shape[0]] += 1
        return gemv(x, *args, prologue=prologue, **kwargs)

    from minivllm.kernels.gemv import gemv

    monkeypatch.setattr(small_batch, "_gemv", counted)
    return calls


def compare(model_dir, prompt_ids, gemv_calls, **args):
    """The greedy tokens without and with the layer; the row counts of the GEMVs the requests' steps
    launched (a GPU engine's warm-up prefills of 8 tokens take the GEMVs too: not counted)."""
    args = {**ARGS, **args}
    expected = tokens(LLM(model_dir, **args, small_batch_gemv=False), prompt_ids)
    assert not gemv_calls
    llm = LLM(model_dir, **args, small_batch_gemv=True)
    gemv_calls.clear()
    assert tokens(llm, prompt_ids) == expected
    return {rows for _, rows in gemv_calls}


def per_prologue(calls) -> dict:
    counts = Counter()
    for (prologue, _), n in calls.items():
        counts[prologue] += n
    return dict(counts)


def test_same_tokens_with_the_norms_and_silu_in_the_gemvs(qwen3_tiny_dir, gemv_calls):
    rows = compare(qwen3_tiny_dir, prompts(2, 0), gemv_calls, attention_backend="triton")  # its fused prologue
    assert rows == {2}  # the decode steps of 2 requests; the prefills (> 16 tokens) took the model's forward
    steps = per_prologue(gemv_calls)["rms_norm"]  # the first layer's QKV, once a step
    # 4 layers: QKV of layers 1-3 and every gate/up after an add; every down after SiLU; every o_proj plain
    assert steps == DECODE_STEPS and per_prologue(gemv_calls) == dict(rms_norm=steps, add_rms_norm=7 * steps,
                                                           silu_and_mul=4 * steps, none=4 * steps)


def test_a_mixture_of_experts_folds_the_norm_into_qkv_only(tmp_path, gemv_calls):
    moe_dir = str(make_model("qwen3-moe-tiny", tmp_path / "moe", seed=0))
    compare(moe_dir, prompts(2, 1), gemv_calls)
    steps = per_prologue(gemv_calls)["rms_norm"]
    # 4 layers, layer 2 dense: QKV of layers 1-3 and the dense layer's gate/up after an add, its down after
    # SiLU; the experts' MLPs keep their own path. (o_proj and the router: plain GEMVs.)
    assert steps == DECODE_STEPS and per_prologue(gemv_calls)["add_rms_norm"] == 4 * steps
    assert per_prologue(gemv_calls)["silu_and_mul"] == steps


def test_by_default_only_single_token_steps_take_the_gemvs(qwen3_tiny_dir, gemv_calls, monkeypatch):
    """With the default MAX_TOKENS one request's decode steps take the GEMVs and two requests' steps (2
    rows) the model's own forward; the tokens are the same either way."""
    monkeypatch.setattr(small_batch, "MAX_TOKENS", DEFAULT_MAX_TOKENS)
    assert compare(qwen3_tiny_dir, prompts(1, 3), gemv_calls) == {1}
    assert per_prologue(gemv_calls)["rms_norm"] == DECODE_STEPS
    gemv_calls.clear()
    assert compare(qwen3_tiny_dir, prompts(2, 3), gemv_calls) == set()


def test_fp8_weights_keep_their_gemms(qwen3_tiny_dir, gemv_calls):
    on_cuda = {"dtype": "bfloat16"} if DEVICE == "cuda" else {}  # the FP8 GEMMs write bfloat16 on a GPU
    compare(qwen3_tiny_dir, prompts(1, 2), gemv_calls, quantization="fp8", **on_cuda)
    assert not gemv_calls


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's check: on a GPU the kernels run natively")
def test_without_the_interpreter_the_option_says_what_to_set(qwen3_tiny_dir):
    code = ("from minivllm.config import Config\n"
            f"Config({qwen3_tiny_dir!r}, device='cpu', small_batch_gemv=True)")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "small_batch_gemv=True on a CPU runs the kernels in Triton's interpreter" in result.stderr
    assert "TRITON_INTERPRET=1" in result.stderr and "or leave small_batch_gemv off" in result.stderr
