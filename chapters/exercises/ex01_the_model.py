"""Chapter 01 exercise: rotary position embeddings (RoPE) and the attention layer's forward that
applies them: the cos/sin table, the rotation of q and k, and the way from the packed QKV projection
to attention (minivllm/layers/rotary_embedding.py, minivllm/models/transformer.py). Write the three
bodies; `make exercise CH=01` runs the RoPE tests, the fused RoPE kernel's tests and the model's
parity with transformers with them. Stuck? chapters/exercises/hints/01_the_model.md, one level at a time.

They replace the engine's RotaryEmbedding class and apply_rotary function (wherever the package
uses them: the model, the fused kernel's reference) and the method DecoderAttention.forward_qkv
(`self` is the attention layer, its modules built by the engine).
"""
import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Exercise 01.1, the table: the cosine and sine of every pair's angle at every position, computed
    once and shared by every layer (chapter 01, "RoPE"). Replaces the engine's RotaryEmbedding.

    RotaryEmbedding(head_dim, max_position, base) holds
      cos_sin_cache: [max_position, head_dim] float32, a buffer (it moves with the module) that is not
        part of the state dict (it is computed, never loaded from a checkpoint). With d = head_dim and
        pair i's frequency w_i = base^(-2i / d), i = 0 .. d/2 - 1, row m is
            [cos(m w_0), ..., cos(m w_{d/2-1}) | sin(m w_0), ..., sin(m w_{d/2-1})]
        (the fused kernel of chapter 09 reads this layout). Float32 whatever torch's default dtype:
        the model is built under its own (bfloat16 on a GPU), in which positions near 4000 round to
        multiples of 16.
      apply_rotary_fn: the function forward calls, apply_rotary (the engine's fused-ops layer may give
        a module a compiled copy).
    forward(positions, q, k) returns apply_rotary_fn(positions, q, k, cos_sin_cache).
    """

    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        raise NotImplementedError("exercise 01.1 (RotaryEmbedding) is not written yet: fill it in, "
                                  "chapters/exercises/ex01_the_model.py; read chapters/01_the_model.md, 'RoPE'")

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        raise NotImplementedError("exercise 01.1 (RotaryEmbedding) is not written yet: fill in forward, "
                                  "chapters/exercises/ex01_the_model.py; read chapters/01_the_model.md, 'RoPE'")


def apply_rotary(positions, q, k, cos_sin_cache):
    """Exercise 01.1, the rotation: q and k turned by their tokens' positions (chapter 01, "RoPE").

    positions: [num_tokens] int64; q: [num_tokens, num_heads, head_dim] and k: [num_tokens,
    num_kv_heads, head_dim] (fewer heads with GQA), in any float dtype; cos_sin_cache: the table above.
    A head's vector x (d = head_dim values) is two halves, x1 = x[:d/2] and x2 = x[d/2:]: pair i is
    (x[i], x[i + d/2]) (the "rotate half" layout of Llama and Qwen), not (x[2i], x[2i + 1]). At
    position m, pair i turns by the angle m w_i as the point (x1[i], x2[i]) of the plane turns
    counterclockwise. Every head of q and of k turns the same way at the same token.
    Compute in float32 and return q and k in their own dtypes, as new tensors (q and k are not modified).
    Returns (q, k) rotated.
    """
    raise NotImplementedError("exercise 01.1 (apply_rotary) is not written yet: fill it in, "
                              "chapters/exercises/ex01_the_model.py; read chapters/01_the_model.md, 'RoPE'")


def forward_qkv(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
    """Exercise 01.1, the attention layer: from the QKV projection's output to the output projection
    (chapter 01, "RoPE", what runs in the model, and "GQA"). Replaces DecoderAttention.forward_qkv;
    DecoderAttention.forward calls it with self.qkv_proj(hidden_states).

    positions: [num_tokens] int64. qkv: [num_tokens, q_size + 2 * kv_size], each token's row packed as
        | q: num_heads * head_dim | k: num_kv_heads * head_dim | v: num_kv_heads * head_dim |
    with q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size, and this layer's
    self.num_heads, self.num_kv_heads, self.head_dim (with GQA, num_kv_heads < num_heads).
    What attention must receive, all [num_tokens, heads, head_dim]:
      q and k: with self.qk_norm (Qwen3), first normalised over each head's head_dim values by
        self.q_norm and self.k_norm, then rotated by self.rotary_emb(positions, q, k);
      v: as the projection wrote it (no norm, no rotation).
    self.attn(q, k, v) stores k and v in the KV cache and attends: [num_tokens, num_heads, head_dim].
    Returns self.o_proj of its heads side by side, [num_tokens, num_heads * head_dim] in, [num_tokens,
    hidden_size] out.
    """
    raise NotImplementedError("exercise 01.1 (forward_qkv) is not written yet: fill it in, "
                              "chapters/exercises/ex01_the_model.py; read chapters/01_the_model.md, 'RoPE'")
