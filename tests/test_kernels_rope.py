"""qk_norm_rope_store (Triton) against qk_norm_rope_store_ref: per-head RMSNorm, RoPE, cache store."""
import pytest
import torch

import conftest_kernels as ck  # noqa: I001 (sets TRITON_INTERPRET before triton is imported)
from conftest_kernels import DEVICE, DTYPES, needs_cuda, randn
from minivllm.kernels import qk_norm_rope_store, qk_norm_rope_store_ref
from minivllm.kernels import qk_norm_rope as rope_module
from minivllm.layers.rotary_embedding import RotaryEmbedding

# Both sides round to the input dtype at the same steps, but the normalized halves may differ by an
# ulp (rsqrt, FMA, the compiled reference's reduction order); RoPE's lo*cos - hi*sin can cancel, so
# the error is absolute: up to ~2 ulps of the inputs' magnitude (|x| ~ 1-4), whatever the output.
ULP_TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=2e-3),
                  torch.bfloat16: dict(atol=5e-2, rtol=1.6e-2)}


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(rope_module, "torch", ck.PoisonedTorch())


def _inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype, norm, block_size=4):
    num_blocks = num_tokens // block_size + 4
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    positions = torch.randint(0, 4000, (num_tokens,), device=DEVICE)
    cos_sin = RotaryEmbedding(head_dim, 4096, 1e6).cos_sin_cache.to(DEVICE)
    weights = [1 + 0.1 * randn(head_dim, dtype=dtype) for _ in range(2)] if norm else [None, None]
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[torch.rand(num_tokens) < 0.25] = -1  # padding tokens store nothing
    caches = [randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype) for _ in range(2)]
    return qkv, positions, cos_sin, weights, slots.to(DEVICE), caches


def _check(num_tokens, num_heads, num_kv_heads, head_dim, dtype, norm, store=True):
    qkv, positions, cos_sin, (wq, wk), slots, (k_cache, v_cache) = _inputs(
        num_tokens, num_heads, num_kv_heads, head_dim, dtype, norm)
    expected_caches = (k_cache.clone(), v_cache.clone())
    args = (qkv, positions, cos_sin, num_heads, num_kv_heads, wq, wk, 1e-6)
    cache_args = dict(k_cache=k_cache, v_cache=v_cache, slot_mapping=slots) if store else {}
    q, k, v = qk_norm_rope_store(*args, **cache_args)
    ref_cache_args = dict(k_cache=expected_caches[0], v_cache=expected_caches[1], slot_mapping=slots) if store else {}
    q_ref, k_ref, v_ref = qk_norm_rope_store_ref(*args, **ref_cache_args)
    tol = ULP_TOLERANCES[dtype]
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(k, k_ref, **tol)
    assert torch.equal(v, v_ref)
    if store:
        torch.testing.assert_close(k_cache, expected_caches[0], **tol)  # stored k is the rotated k
        assert torch.equal(v_cache, expected_caches[1])
        untouched = torch.ones(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool, device=DEVICE)
        untouched[slots[slots >= 0]] = False
        assert torch.equal(k_cache.flatten(0, 1)[untouched], expected_caches[0].flatten(0, 1)[untouched])
    return q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False])
def test_matches_reference(dtype, norm):
    _check(num_tokens=13, num_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype, norm=norm)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(16, 8, 128), (6, 2, 80), (3, 3, 96), (8, 1, 64)])
def test_head_shapes(num_heads, num_kv_heads, head_dim):
    _check(num_tokens=7, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
           dtype=torch.float32, norm=True)


def test_without_cache_and_empty():
    _check(num_tokens=5, num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, norm=True, store=False)
    qkv, positions, cos_sin, (wq, wk), _, _ = _inputs(0, 4, 2, 64, torch.float32, True)
    q, k, v = qk_norm_rope_store(qkv, positions, cos_sin, 4, 2, wq, wk)
    assert q.shape == (0, 4, 64) and k.shape == v.shape == (0, 2, 64)


def test_position_zero_is_identity_rotation():
    """At position 0 RoPE is the identity: without a norm q and k come back unchanged."""
    qkv, _, cos_sin, _, _, _ = _inputs(3, 4, 2, 64, torch.float32, False)
    q, k, _ = qk_norm_rope_store(qkv, torch.zeros(3, dtype=torch.int64, device=DEVICE), cos_sin, 4, 2)
    assert torch.equal(q.flatten(1), qkv[:, :256]) and torch.equal(k.flatten(1), qkv[:, 256:384])


def test_argument_errors():
    qkv, positions, cos_sin, (wq, wk), _, _ = _inputs(3, 4, 2, 64, torch.float32, True)
    with pytest.raises(AssertionError, match="qkv must be"):
        qk_norm_rope_store(qkv, positions, cos_sin, 4, 4)
    with pytest.raises(AssertionError, match="both"):
        qk_norm_rope_store(qkv, positions, cos_sin, 4, 2, wq, None)


@needs_cuda
@pytest.mark.parametrize("num_tokens", [256, 16384])
def test_bf16_engine_shapes(num_tokens):
    """Qwen3-0.6B's shapes in bf16: a decode batch and a full prefill, with the cache store."""
    _check(num_tokens=num_tokens, num_heads=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, norm=True)
