"""transformers as the reference the engine is compared with, token for token (float32, CPU)."""
import torch
from transformers import AutoModelForCausalLM


def hf_greedy(model_dir, prompts, num_new_tokens):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=num_new_tokens, min_new_tokens=num_new_tokens, do_sample=False)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs
