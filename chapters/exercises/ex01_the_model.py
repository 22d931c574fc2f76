"""Chapter 01 exercise: the rotation at the heart of RoPE (minivllm/layers/rotary_embedding.py).
Write the function's body; `make exercise CH=01` runs the RoPE kernel's tests and the model's parity
with transformers with it.
"""
import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Exercise 01.1: rotate each pair (x[i], x[i + d/2]) of every head by its angle (chapter 01, "RoPE").

    x: [num_tokens, num_heads, head_dim] in any float dtype; cos, sin: [num_tokens, 1, head_dim / 2]
    float32, the cosine and sine of each pair's angle at each token's position.
    With x1 = x[..., :d/2] and x2 = x[..., d/2:] (the "rotate half" layout of Qwen and Llama), the
    result is [x1 * cos - x2 * sin | x2 * cos + x1 * sin], computed in float32 and returned in x's dtype.
    """
    raise NotImplementedError("exercise 01.1 (_rotate) is not written yet: fill it in, "
                              "chapters/exercises/ex01_the_model.py; read chapters/01_the_model.md, 'RoPE'")
