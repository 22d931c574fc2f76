"""minivllm's models against transformers: same weights, same logits (float32, CPU)."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from minivllm.core.attention import prefill_metadata, set_forward_context
from minivllm.models.loader import build_model

BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0)

SHAPES = {
    "qwen3-gqa2-tied": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3-gqa3-untied": (Qwen3Config, Qwen3ForCausalLM, dict(num_attention_heads=6, num_key_value_heads=2,
                                                              tie_word_embeddings=False)),
    "qwen3-odd-hidden": (Qwen3Config, Qwen3ForCausalLM, dict(hidden_size=200, head_dim=40, num_attention_heads=5,
                                                             num_key_value_heads=5, intermediate_size=150)),
    "llama-gqa2-untied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False, head_dim=16)),
    "llama-gqa4-tied": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=8, num_key_value_heads=2,
                                                            head_dim=8, tie_word_embeddings=True)),
}


def save_random_hf_model(tmp_path, config_cls, model_cls, overrides, seed=0):
    config = config_cls(**{**BASE, **overrides})
    torch.manual_seed(seed)
    hf = model_cls(config).eval()
    hf.save_pretrained(tmp_path)
    return hf


def minivllm_logits(model, prompts):
    input_ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for p in prompts for i in range(len(p))])
    with torch.no_grad(), set_forward_context(prefill_metadata([len(p) for p in prompts])):
        return model.compute_logits(model(input_ids, positions))


def assert_logits_match(model, hf, prompts):
    """minivllm's packed batch against transformers one prompt at a time: within 1e-4 + 1e-5 * |logit| (float32;
    the CPU's thread count changes the matmuls' summation order, by up to ~1e-4 on SmolLM2's 30 layers)."""
    ours = minivllm_logits(model, prompts)
    offset = 0
    for prompt in prompts:
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours[offset:offset + len(prompt)], expected, atol=1e-4, rtol=1e-5)
        offset += len(prompt)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_logits_match_transformers(tmp_path, shape):
    config_cls, model_cls, overrides = SHAPES[shape]
    hf = save_random_hf_model(tmp_path, config_cls, model_cls, overrides)
    model = build_model(str(tmp_path))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, BASE["vocab_size"], (n,), generator=gen).tolist() for n in (1, 7, 33, 70)]
    assert_logits_match(model, hf, prompts)


def test_smollm2_logits_match_transformers(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    questions = ["What is the capital of France?", "Write a haiku about rain.", "Explain gravity briefly."]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in questions]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
    model = build_model(str(smollm2_dir))
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert_logits_match(model, hf, prompts)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lm_head_stores_float32_logits(device, dtype):
    """Half-precision hidden states and head, float32 logits: the GEMM's float32 sums, not their
    rounding. Two logits 0.0625 apart near 25 are one value in bfloat16 (steps of 0.125)."""
    from minivllm.layers.embed_head import ParallelLMHead

    head = ParallelLMHead(4, 2).to(device=device, dtype=dtype)
    head.weight.copy_(torch.tensor([[25.0, 0.0], [25.0, 0.0625], [1.0, 1.0], [-3.0, 0.5]]))
    hidden = torch.tensor([[1.0, 1.0], [0.5, -2.0]], device=device, dtype=dtype)
    logits = head(hidden)
    assert logits.dtype == torch.float32
    expected = hidden.float() @ head.weight.float().t()
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)
    assert logits[0, 1] - logits[0, 0] == 0.0625  # rounded to bfloat16 both would be 25.0
