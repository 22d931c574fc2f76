"""RoPE (minivllm/layers/rotary_embedding.py) and the attention layer that applies it
(DecoderAttention.forward_qkv in minivllm/models/transformer.py): the cos/sin table, each pair
(i, i + d/2) turned by its angle, scores that depend only on the distance between two positions,
float32 arithmetic for half-precision inputs, and what the layer hands to attention.

With tests/test_kernels_rope.py and the model's parity with transformers they grade exercise 01.1;
the known wrong answers at the end must fail them (the grader can fail). The classes and functions
are looked up in their modules when a test runs, so the tests see whatever the exercise switch put there.
"""
import math

import pytest
import torch
from transformers import Qwen3Config

from minivllm.layers import rotary_embedding as rope
from minivllm.layers.context import ModelContext
from minivllm.models import transformer
from wrong_answers import builds_on_the_engine, case_id, rejected

HEAD_DIM, MAX_POSITION, BASE = 16, 4096, 10000.0


def rotary(head_dim=HEAD_DIM, max_position=MAX_POSITION, base=BASE):
    return rope.RotaryEmbedding(head_dim, max_position, base)


def rotate_by_hand(x, positions, base=BASE):
    """Each pair (x[i], x[i + d/2]) of each head turned by position * base^(-2i/d), counterclockwise,
    one pair at a time in float64: the obviously right rotation."""
    head_dim = x.shape[-1]
    half = head_dim // 2
    out = x.double().clone()
    for token, m in enumerate(positions.tolist()):
        for i in range(half):
            angle = m * base ** (-2 * i / head_dim)
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[token, :, i].double(), x[token, :, i + half].double()
            out[token, :, i], out[token, :, i + half] = a * c - b * s, b * c + a * s
    return out


def test_the_table_is_cos_then_sin_of_each_pairs_angle_in_float32():
    """Built under a bfloat16 default dtype (as the model is on a GPU), the table is still float32 and
    right at every position: cos | sin of m * base^(-2i/d). Float32 angles up to 4095 radians are off
    by ~5e-4; bfloat16 ones by whole radians. A buffer, not a checkpoint tensor."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        embedding = rotary()
    finally:
        torch.set_default_dtype(previous)
    table = embedding.cos_sin_cache
    assert table.dtype == torch.float32 and table.shape == (MAX_POSITION, HEAD_DIM)
    positions = torch.arange(MAX_POSITION, dtype=torch.float64)[:, None]
    frequencies = BASE ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angles = positions * frequencies  # [max_position, d/2]
    expected = torch.cat([angles.cos(), angles.sin()], dim=-1)
    torch.testing.assert_close(table.double(), expected, atol=2e-3, rtol=0)
    assert torch.equal(table[0], torch.tensor([1.0] * (HEAD_DIM // 2) + [0.0] * (HEAD_DIM // 2)))
    assert "cos_sin_cache" in dict(embedding.named_buffers())
    assert "cos_sin_cache" not in embedding.state_dict()  # the loader expects only checkpoint tensors


def test_position_zero_leaves_q_and_k_unchanged():
    q, k = torch.randn(3, 4, HEAD_DIM), torch.randn(3, 2, HEAD_DIM)
    q_rot, k_rot = rotary()(torch.zeros(3, dtype=torch.int64), q, k)
    torch.testing.assert_close(q_rot, q, atol=0, rtol=0)
    torch.testing.assert_close(k_rot, k, atol=0, rtol=0)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 2, 16), (6, 2, 40), (3, 3, 8)])
def test_each_pair_turns_by_its_angle(num_heads, num_kv_heads, head_dim):
    """q and k (GQA: fewer k heads) at ragged positions against the pair-by-pair rotation; new tensors
    in the inputs' dtype, the inputs untouched."""
    positions = torch.tensor([0, 1, 7, 100, 233, 500, 511])
    q, k = torch.randn(7, num_heads, head_dim), torch.randn(7, num_kv_heads, head_dim)
    q_before, k_before = q.clone(), k.clone()
    q_rot, k_rot = rotary(head_dim=head_dim)(positions, q, k)
    assert q_rot.shape == q.shape and k_rot.shape == k.shape
    assert q_rot.dtype == k_rot.dtype == torch.float32
    # float32 angles at position 511 are off by ~1e-4 radians, times |x| <~ 4
    torch.testing.assert_close(q_rot.double(), rotate_by_hand(q, positions), atol=1e-3, rtol=0)
    torch.testing.assert_close(k_rot.double(), rotate_by_hand(k, positions), atol=1e-3, rtol=0)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


def score(embedding, q, k, m, n):
    """q at position m against k at position n, both rotated."""
    q_rot, k_rot = embedding(torch.tensor([m, n]), torch.stack([q, q]), torch.stack([k, k]))
    return torch.dot(q_rot[0, 0].double(), k_rot[1, 0].double()).item()


def test_scores_depend_only_on_the_distance():
    """RoPE's point: q rotated by its position m and k by its position n score q.k as a function of
    m - n. Shifting both positions keeps every score; changing the distance changes it."""
    torch.manual_seed(0)
    embedding = rotary()
    q, k = torch.randn(1, HEAD_DIM), torch.randn(1, HEAD_DIM)
    for m, n in [(5, 2), (40, 40), (3, 17), (900, 10)]:
        base_score = score(embedding, q, k, m, n)
        for shift in (1, 64, 150):  # float32 angles below ~1100 radians: scores within ~1e-3
            assert score(embedding, q, k, m + shift, n + shift) == pytest.approx(base_score, abs=3e-3)
        assert abs(score(embedding, q, k, m, n + 1) - base_score) > 1e-2  # the position is in the score


def test_half_precision_is_rotated_in_float32():
    """float16 q and k come back float16, rounded once from the float32 rotation (rotating in float16
    rounds every product and sum)."""
    torch.manual_seed(1)
    embedding = rotary(head_dim=64)
    positions = torch.randint(0, MAX_POSITION, (33,))
    q, k = (4 * torch.randn(33, 4, 64)).half(), (4 * torch.randn(33, 2, 64)).half()
    q_rot, k_rot = embedding(positions, q, k)
    assert q_rot.dtype == k_rot.dtype == torch.float16
    q_exact, k_exact = embedding(positions, q.float(), k.float())
    assert torch.equal(q_rot, q_exact.half()) and torch.equal(k_rot, k_exact.half())


# ---- the attention layer ---------------------------------------------------------------------

class RecordingAttention(torch.nn.Module):
    """Stands in for the layer's Attention: records what it is given, returns a fixed output."""

    def forward(self, q, k, v):
        self.q, self.k, self.v = q, k, v
        self.out = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
        return self.out


def attention_layer(num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM, qk_norm=True):
    """A Qwen3-style attention layer with random weights, norm weights that are not ones (the order of
    norm and rotation then matters) and a recording stand-in for attention."""
    config = Qwen3Config(hidden_size=48, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         head_dim=head_dim, rms_norm_eps=1e-6, vocab_size=32, intermediate_size=32)
    torch.manual_seed(2)
    layer = transformer.DecoderAttention(config, rotary(head_dim=head_dim), qk_norm, ModelContext())
    for parameter in layer.parameters():
        parameter.data.normal_()
    layer.attn = RecordingAttention()
    return layer


@pytest.mark.parametrize("num_heads, num_kv_heads, qk_norm", [(4, 2, True), (6, 2, True), (4, 1, False)])
def test_the_layer_normalises_then_rotates_q_and_k(num_heads, num_kv_heads, qk_norm):
    """What attention receives from the packed projection: q and k split into their heads (GQA: fewer
    k heads), normalised per head (Qwen3) and then rotated; v as the projection wrote it. The layer
    returns o_proj of attention's heads side by side."""
    layer = attention_layer(num_heads, num_kv_heads, qk_norm=qk_norm)
    positions = torch.tensor([0, 3, 4, 17, 200])
    qkv = torch.randn(5, (num_heads + 2 * num_kv_heads) * HEAD_DIM)
    with torch.no_grad():
        out = layer.forward_qkv(positions, qkv)
    q, k, v = qkv.split([num_heads * HEAD_DIM, num_kv_heads * HEAD_DIM, num_kv_heads * HEAD_DIM], dim=-1)
    q, k, v = q.view(5, num_heads, HEAD_DIM), k.view(5, num_kv_heads, HEAD_DIM), v.view(5, num_kv_heads, HEAD_DIM)
    if qk_norm:  # RMSNorm over each head, by hand
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * layer.q_norm.weight
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * layer.k_norm.weight
    recorded = layer.attn
    torch.testing.assert_close(recorded.q.double(), rotate_by_hand(q, positions), atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(recorded.k.double(), rotate_by_hand(k, positions), atol=1e-3, rtol=1e-4)
    assert torch.equal(recorded.v, v)
    with torch.no_grad():
        expected = layer.o_proj(recorded.out.flatten(1, 2))
    assert out.shape == (5, 48)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


# ------------------------------------------------------------------------------------------------
# Known wrong answers: each must fail a check that grades exercise 01.1
# ------------------------------------------------------------------------------------------------

ENGINE_ROTARY = rope.RotaryEmbedding
ENGINE_APPLY_ROTARY = rope.apply_rotary
ENGINE_FORWARD_QKV = transformer.DecoderAttention.forward_qkv


class RotaryThatDoesNothing(ENGINE_ROTARY):
    """The trivial answer: q and k as they came."""

    def forward(self, positions, q, k):
        return q.clone(), k.clone()


class RotaryWithInterleavedPairs(ENGINE_ROTARY):
    """Pairs (x[2i], x[2i + 1]) (GPT-J's layout), not (x[i], x[i + d/2]): another model's RoPE."""

    def forward(self, positions, q, k):
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)

        def turn(x):
            x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
            return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2).to(x.dtype)

        return turn(q), turn(k)


class RotaryTheWrongWay(ENGINE_ROTARY):
    """Turns each pair clockwise: the sines' sign swapped."""

    def __init__(self, head_dim, max_position, base):
        super().__init__(head_dim, max_position, base)
        half = head_dim // 2
        self.cos_sin_cache[:, half:] *= -1


class RotaryWithHalfTheFrequencyExponent(ENGINE_ROTARY):
    """w_i = base^(-i/d) instead of base^(-2i/d): the pairs turn at the wrong speeds."""

    def __init__(self, head_dim, max_position, base):
        super().__init__(head_dim, max_position, base)
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim // 2, dtype=torch.float) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        self.cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class RotaryWithATableInTheDefaultDtype(ENGINE_ROTARY):
    """The table in torch's default dtype: bfloat16 when the model is built in bfloat16."""

    def __init__(self, head_dim, max_position, base):
        super().__init__(head_dim, max_position, base)
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2) / head_dim))
        freqs = torch.outer(torch.arange(max_position).to(inv_freq.dtype), inv_freq)
        self.cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def rotary_in_the_inputs_dtype(positions, q, k, cos_sin_cache):
    """Rotates in float16 when q and k are float16: every product and sum rounded."""
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)

    def turn(x):
        x1, x2 = x.chunk(2, dim=-1)
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    return turn(q), turn(k)


def rotary_of_q_only(positions, q, k, cos_sin_cache):
    """k stays where it was: scores then depend on q's absolute position."""
    q_rot, _ = ENGINE_APPLY_ROTARY(positions, q, k, cos_sin_cache)
    return q_rot, k.clone()


def forward_qkv_rotating_before_the_norm(self, positions, qkv):
    """RoPE first, then the per-head norms (transformers' Qwen3 normalises first)."""
    q, k, v = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
    q, k = self.rotary_emb(positions, q.view(-1, self.num_heads, self.head_dim),
                           k.view(-1, self.num_kv_heads, self.head_dim))
    if self.qk_norm:
        q, k = self.q_norm(q), self.k_norm(k)
    return self.o_proj(self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim)).flatten(1, 2))


def forward_qkv_with_k_and_v_swapped(self, positions, qkv):
    """Reads v where k is packed and k where v is."""
    q, v, k = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
    return ENGINE_FORWARD_QKV(self, positions, torch.cat([q, k, v], dim=-1))


def check_the_table():
    test_the_table_is_cos_then_sin_of_each_pairs_angle_in_float32()


def check_each_pair():
    test_each_pair_turns_by_its_angle(4, 2, 16)


def check_the_layer():
    test_the_layer_normalises_then_rotates_q_and_k(4, 2, True)


def check_parity_with_qwen3(tmp_path_factory):
    from test_model_parity import test_logits_match_transformers

    test_logits_match_transformers(tmp_path_factory.mktemp("qwen3"), "qwen3-gqa2-tied")


# (Norm weights of ones, as a fresh transformers model has, commute with the rotation: the parity test
# cannot tell the order of norm and RoPE, check_the_layer's random weights can.)
@builds_on_the_engine
@pytest.mark.parametrize("name, wrong, check", [
    ("RotaryEmbedding", RotaryThatDoesNothing, test_scores_depend_only_on_the_distance),
    ("RotaryEmbedding", RotaryThatDoesNothing, check_each_pair),
    ("RotaryEmbedding", RotaryWithInterleavedPairs, check_each_pair),
    ("RotaryEmbedding", RotaryTheWrongWay, check_each_pair),
    ("RotaryEmbedding", RotaryWithHalfTheFrequencyExponent, check_the_table),
    ("RotaryEmbedding", RotaryWithATableInTheDefaultDtype, check_the_table),
    ("apply_rotary", rotary_in_the_inputs_dtype, test_half_precision_is_rotated_in_float32),
    ("apply_rotary", rotary_of_q_only, test_scores_depend_only_on_the_distance),
    ("forward_qkv", forward_qkv_rotating_before_the_norm, check_the_layer),
    ("forward_qkv", forward_qkv_with_k_and_v_swapped, check_the_layer),
    ("forward_qkv", forward_qkv_with_k_and_v_swapped, check_parity_with_qwen3),
    ("RotaryEmbedding", RotaryWithInterleavedPairs, check_parity_with_qwen3),
], ids=case_id)
def test_the_rope_checks_reject_a_wrong_table_rotation_or_layer(name, wrong, check, tmp_path_factory):
    owner = transformer.DecoderAttention if name == "forward_qkv" else rope
    run = (lambda: check(tmp_path_factory)) if check is check_parity_with_qwen3 else check
    with pytest.MonkeyPatch.context() as patch:
        if name == "RotaryEmbedding":  # the model's layers take it from models/transformer.py
            patch.setattr(transformer, name, wrong)
        rejected(run, owner, name, wrong)
