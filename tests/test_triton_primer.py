"""The primer's four kernels (kernels/primer.py) against their references, on ragged sizes; and, for
each, a known wrong answer that the same check must reject (the grader of exercises 04b.1-04b.4 can fail).

Each `check_*` takes the function under test, so the wrong answers (plain torch) go through exactly the
assertions that grade the kernel.
"""
import pytest
import torch

import conftest_kernels as ck  # noqa: I001 (sets TRITON_INTERPRET before triton is imported)
from conftest_kernels import DEVICE, DTYPES, randn
from minivllm.kernels import primer

DTYPE_IDS = [str(dtype).removeprefix("torch.") for dtype in DTYPES]


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    # Outputs start NaN-filled: an element no program stores fails the comparison.
    monkeypatch.setattr(primer, "torch", ck.PoisonedTorch())


def assert_close(actual, expected, input_dtype):
    """Kernel vs reference with the tolerance of the inputs' dtype (fp32 dots run in tf32 on a GPU)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (
        f"got {tuple(actual.shape)} {actual.dtype}, expected {tuple(expected.shape)} {expected.dtype}")
    assert not actual.isnan().any(), "NaN in the output (an element was never written, or exp overflowed?)"
    torch.testing.assert_close(actual.float(), expected.float(), **ck.TOLERANCES[input_dtype])


def check_vector_add(fn, n, dtype):
    x, y = randn(n, dtype=dtype), randn(n, dtype=dtype)
    assert_close(fn(x, y), primer.vector_add_ref(x, y), dtype)


def check_softmax_rows(fn, num_rows, n_cols, dtype):
    # Rows near +1000 and -1000 in turn: exp(x) overflows (or every term underflows) even in float32
    # unless the row's max is subtracted first, and padding that loads as 0 would win a row's max.
    offsets = 1000 * (1 - 2 * (torch.arange(num_rows, device=DEVICE) % 2))  # [num_rows]: +1000, -1000, ...
    x = (offsets[:, None] + 4 * randn(num_rows, n_cols, dtype=torch.float32)).to(dtype)
    assert_close(fn(x), primer.softmax_rows_ref(x), dtype)


def check_matmul(fn, M, N, K, dtype, transpose_b=False):
    a = randn(M, K, dtype=dtype)
    b = randn(N, K, dtype=dtype).T if transpose_b else randn(K, N, dtype=dtype)  # [K, N], maybe strided
    assert_close(fn(a, b), primer.matmul_ref(a, b), dtype)


def check_causal_tile(fn, M, N, D, dtype):
    q, k = randn(M, D, dtype=dtype), randn(N, D, dtype=dtype)
    assert_close(fn(q, k, D**-0.5), primer.causal_tile_ref(q, k, D**-0.5), dtype)


# ------------------------------------------------------------------------------------------------
# The kernels (CPU tensors under TRITON_INTERPRET, set by conftest_kernels without a GPU; else CUDA)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 7, 233, 1000, 1024, 3000])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_vector_add(n, dtype):
    check_vector_add(primer.vector_add, n, dtype)


@pytest.mark.parametrize("num_rows, n_cols", [(1, 1), (7, 7), (3, 233), (2, 1000)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_softmax_rows(num_rows, n_cols, dtype):
    check_softmax_rows(primer.softmax_rows, num_rows, n_cols, dtype)


def test_softmax_rows_of_a_strided_view():
    x = randn(5, 64, dtype=torch.float32)[:, :40]  # row stride 64, 40 columns
    torch.testing.assert_close(primer.softmax_rows(x), primer.softmax_rows_ref(x))


# (M, N, K): one element; sizes below one tile; a ragged tile edge in every dim and a K tail (70 = 2 x 32 + 6)
MATMUL_SHAPES = [(1, 1, 1), (7, 7, 7), (233, 40, 70), (16, 100, 33)]


@pytest.mark.parametrize("M, N, K", MATMUL_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_matmul(M, N, K, dtype):
    check_matmul(primer.matmul, M, N, K, dtype)


def test_matmul_reads_strided_b():
    check_matmul(primer.matmul, 33, 40, 70, DTYPES[0], transpose_b=True)


def test_matmul_tile_configs():
    a, b = randn(50, 40, dtype=torch.float32), randn(40, 70, dtype=torch.float32)
    for block_m, block_n, block_k in [(16, 16, 16), (32, 64, 16), (64, 16, 64)]:
        actual = primer.matmul(a, b, block_m=block_m, block_n=block_n, block_k=block_k)
        assert_close(actual, primer.matmul_ref(a, b), torch.float32)


# (M, N): prefill (M = N), a chunk after a cached prefix (N > M), and N < M (the first rows see no key)
CAUSAL_SHAPES = [(1, 1), (7, 7), (7, 40), (70, 70), (40, 7)]


@pytest.mark.parametrize("M, N", CAUSAL_SHAPES)
@pytest.mark.parametrize("D", [16, 40])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_causal_tile(M, N, D, dtype):
    check_causal_tile(primer.causal_tile, M, N, D, dtype)


# ------------------------------------------------------------------------------------------------
# Known wrong answers: each must fail the check that grades the kernel
# ------------------------------------------------------------------------------------------------

def _rejected(check, wrong_fn, *args):
    with pytest.raises(AssertionError):
        check(wrong_fn, *args)


def test_the_checks_reject_wrong_vector_adds():
    _rejected(check_vector_add, lambda x, y: x.clone(), 1000, torch.float32)  # forgot y
    _rejected(check_vector_add, lambda x, y: torch.cat([x[:-7] + y[:-7], x.new_zeros(7)]), 1000,
              torch.float32)  # the tail never written (zeros here, NaN in a kernel's poisoned output)


def softmax_without_the_max(x):
    e = x.float().exp()
    return (e / e.sum(-1, keepdim=True)).to(x.dtype)


def softmax_with_zero_padding(x):
    block_n = 1 << (x.shape[1] - 1).bit_length()  # BLOCK_N, the padding loaded as 0 instead of -inf
    padded = torch.nn.functional.pad(x.float(), (0, block_n - x.shape[1]))
    return torch.softmax(padded, dim=-1)[:, :x.shape[1]].to(x.dtype)


def test_the_checks_reject_a_softmax_without_the_max_subtraction():
    _rejected(check_softmax_rows, softmax_without_the_max, 1, 233, torch.float32)  # exp(1000) = inf
    _rejected(check_softmax_rows, softmax_without_the_max, 3, 233, torch.float16)


def test_the_checks_reject_a_softmax_whose_padding_is_not_minus_inf():
    _rejected(check_softmax_rows, softmax_with_zero_padding, 3, 233, torch.float32)  # the -1000 row


def matmul_without_the_k_tail(a, b, block_k=32):
    k_full = a.shape[1] // block_k * block_k  # whole BLOCK_K steps only: K = 70 loses its last 6
    return (a[:, :k_full].float() @ b[:k_full].float()).to(a.dtype)


def test_the_checks_reject_a_matmul_that_drops_the_k_tail():
    _rejected(check_matmul, matmul_without_the_k_tail, 233, 40, 70, torch.float32)
    _rejected(check_matmul, matmul_without_the_k_tail, 7, 7, 7, torch.float16)  # K < BLOCK_K: all lost


def causal_tile_without_the_mask(q, k, scale):
    return (q.float() @ k.float().T) * scale


def causal_tile_top_left(q, k, scale):
    scores = (q.float() @ k.float().T) * scale
    return scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))  # j > i


def test_the_checks_reject_causal_tiles_with_a_wrong_mask():
    _rejected(check_causal_tile, causal_tile_without_the_mask, 70, 70, 16, torch.float32)
    _rejected(check_causal_tile, causal_tile_top_left, 7, 40, 16, torch.float32)  # aligned top-left
    check_causal_tile(causal_tile_top_left, 7, 7, 16, torch.float32)  # (the same when M = N)
