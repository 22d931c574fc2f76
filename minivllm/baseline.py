"""Chapter 00: the naive generate loop every later chapter improves on.

One static batch, left-padded to its longest prompt; one contiguous KV cache per sequence, sized
for prompt + max_tokens up front; every sequence runs until the slowest one is done. No paging, no
prefix caching, no continuous batching, no CUDA graphs. It reuses the engine's layers and loader
(same weights, same numerics) and only replaces the attention with a padded, masked one.
vLLM has no such file; it is what transformers' `generate` does with a static cache.
"""
import torch

from minivllm.layers.rotary_embedding import apply_rotary
from minivllm.models.loader import build_model, load_hf_config


def load(model_dir: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """The engine's model class with the checkpoint's weights, and the model's EOS id."""
    hf_config = load_hf_config(model_dir)
    eos = getattr(hf_config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, list) else eos  # the engine's choice too (minivllm/config.py)
    return build_model(model_dir, hf_config, dtype=dtype, device=device), eos


def attention(attn, hidden, positions, k_cache, v_cache, start, key_mask):
    """One layer's attention over a contiguous cache.

    hidden: [batch * num_new, hidden]; positions: [batch, num_new]; k_cache, v_cache: [batch, max_len,
    num_kv_heads, head_dim]; the new tokens go to columns start .. start + num_new; key_mask:
    [batch, max_len], False on padding.
    """
    batch, num_new = positions.shape
    num_heads, num_kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q, k, v = attn.qkv_proj(hidden).split([num_heads * head_dim, num_kv_heads * head_dim,
                                           num_kv_heads * head_dim], dim=-1)
    q = q.view(batch * num_new, num_heads, head_dim)
    k = k.view(batch * num_new, num_kv_heads, head_dim)
    if attn.qk_norm:  # Qwen3: RMSNorm over each head before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rotary(positions.flatten(), q, k, attn.rotary_emb.cos_sin_cache)
    end = start + num_new
    k_cache[:, start:end] = k.view(batch, num_new, num_kv_heads, head_dim)
    v_cache[:, start:end] = v.view(batch, num_new, num_kv_heads, head_dim)
    group = num_heads // num_kv_heads  # GQA: each cached KV head serves `group` query heads
    keys = k_cache[:, :end].repeat_interleave(group, dim=2)  # [batch, end, num_heads, head_dim]
    values = v_cache[:, :end].repeat_interleave(group, dim=2)
    q = q.view(batch, num_new, num_heads, head_dim)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, keys).float() * head_dim**-0.5  # softmax in float32
    query_cols = torch.arange(start, end, device=hidden.device).unsqueeze(1)  # [num_new, 1]
    key_cols = torch.arange(end, device=hidden.device).unsqueeze(0)  # [1, end]
    # causal and not padding; every token also sees itself, so a padding row's softmax stays finite
    allowed = ((key_cols <= query_cols) & key_mask[:, None, None, :end]) | (key_cols == query_cols)
    probs = scores.masked_fill_(~allowed, float("-inf")).softmax(dim=-1).to(values.dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, values)
    return attn.o_proj(out.reshape(batch * num_new, num_heads * head_dim))


def forward(model, input_ids, positions, k_caches, v_caches, start, key_mask):
    """The decoder of minivllm/models/transformer.py, layer by layer; logits of the last column.

    Outside attention, the layers see the batch's tokens as one flat [batch * num_new, hidden] list, as
    in the engine; only attention needs the rows.
    """
    hidden, residual = model.model.embed_tokens(input_ids.flatten()), None  # [batch * num_new, hidden]
    for layer, k_cache, v_cache in zip(model.model.layers, k_caches, v_caches):
        if residual is None:
            residual, hidden = hidden, layer.input_layernorm(hidden)
        else:
            hidden, residual = layer.input_layernorm(hidden, residual)
        hidden = attention(layer.self_attn, hidden, positions, k_cache, v_cache, start, key_mask)
        hidden, residual = layer.post_attention_layernorm(hidden, residual)
        hidden = layer.mlp(hidden)
    hidden, _ = model.model.norm(hidden, residual)
    return model.compute_logits(hidden.view(*input_ids.shape, -1)[:, -1])  # [batch, vocab]


def sample(logits, temperature: float, generator: torch.Generator | None):
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = (logits.float() / temperature).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


@torch.inference_mode()
def generate(model, prompts: list[list[int]], max_tokens: int | list[int], temperature: float = 0.0,
             eos_token_id: int | None = None, seed: int = 0) -> list[list[int]]:
    """Generate up to `max_tokens` tokens (one for all, or one per prompt) for every prompt as one
    static batch; returns the completions."""
    max_tokens = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    if not prompts or any(len(p) == 0 for p in prompts) or len(max_tokens) != len(prompts) \
            or min(max_tokens) < 1 or temperature < 0:
        raise ValueError("need non-empty prompts, max_tokens >= 1 for each and temperature >= 0")
    weight = model.lm_head.weight
    config, device = model.config, weight.device
    batch, prompt_len = len(prompts), max(len(p) for p in prompts)
    max_len = prompt_len + max(max_tokens)
    num_pads = torch.tensor([prompt_len - len(p) for p in prompts], device=device)
    # Left padding: every prompt ends in the same column, so each step writes one shared column.
    input_ids = torch.tensor([[0] * (prompt_len - len(p)) + p for p in prompts], device=device)
    key_mask = torch.arange(max_len, device=device).unsqueeze(0) >= num_pads.unsqueeze(1)  # [batch, max_len]
    positions = (torch.arange(prompt_len, device=device) - num_pads.unsqueeze(1)).clamp(min=0)
    head_dim = model.model.layers[0].self_attn.head_dim
    cache_shape = (batch, max_len, config.num_key_value_heads, head_dim)  # reserved for the longest case
    k_caches = [torch.zeros(cache_shape, dtype=weight.dtype, device=device) for _ in model.model.layers]
    v_caches = [torch.zeros(cache_shape, dtype=weight.dtype, device=device) for _ in model.model.layers]
    generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    completions, finished = [[] for _ in prompts], [False] * batch
    start = 0
    for _ in range(max(max_tokens)):
        logits = forward(model, input_ids, positions, k_caches, v_caches, start, key_mask)
        token_ids = sample(logits, temperature, generator).tolist()
        for i, token_id in enumerate(token_ids):
            if not finished[i]:  # a finished sequence keeps its seat and its compute until the end
                completions[i].append(token_id)
                finished[i] = token_id == eos_token_id or len(completions[i]) == max_tokens[i]
        if all(finished):
            break
        start += input_ids.shape[1]
        input_ids = torch.tensor(token_ids, device=device).unsqueeze(1)  # [batch, 1]
        positions = positions[:, -1:] + 1
    return completions
