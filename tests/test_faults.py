"""Faults in the middle of `generate`: a step that raises (an exception, Ctrl-C) leaves the engine
usable, with every KV block freed and nothing half-written left in the prefix cache.

The CPU tests pin the engine to the CPU (float32); the Triton backend there runs in the interpreter.
`test_failed_step_on_gpu` runs the same scenario on a CUDA GPU (eager, so the faulty layer runs)."""
import contextlib

import pytest

from conftest_kernels import needs_cuda, needs_interpreter
from minivllm import LLM, SamplingParams
from minivllm.core.attention import get_forward_context

ARGS = dict(device="cpu", max_model_len=128, max_num_batched_tokens=256, max_num_seqs=8, kvcache_block_size=8,
            num_kvcache_blocks=64)
SHARED = list(range(40, 60))  # 20 tokens: two full blocks of 8 that the prompts below share


class InjectedFault(RuntimeError):
    pass


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """Two layers, small enough for the Triton interpreter."""
    from minivllm.tools.make_model import make_model

    return str(make_model({"preset": "qwen3-tiny", "num_hidden_layers": 2, "hidden_size": 128,
                           "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2},
                          tmp_path_factory.mktemp("ckpt") / "tiny-2l"))


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@contextlib.contextmanager
def fault_in_last_layer(llm, when, exc=InjectedFault):
    """Raise `exc` inside the last decoder layer's forward on the first call where `when(positions)`
    holds: the earlier layers have written this step's KV, the last one has not."""
    layer = llm.model_runner.model.model.layers[-1]
    forward = layer.forward
    fired = []

    def faulty(positions, *args):
        if not fired and when(positions):
            fired.append(True)
            raise exc("injected fault")
        return forward(positions, *args)

    layer.forward = faulty
    try:
        yield fired
    finally:
        del layer.forward


def at_prefill(positions):
    return get_forward_context().is_prefill


def at_decode_of_position(pos):
    return lambda positions: not get_forward_context().is_prefill and bool((positions == pos).any())


def poisoned(llm):
    """Fill the KV cache with a large value, so that reading a slot nobody wrote changes the output
    (masked slots still contribute nothing)."""
    llm.model_runner.kv_cache.fill_(30.0)
    return llm


def assert_all_blocks_free(llm):
    manager = llm.scheduler.kv_cache_manager
    assert not llm.has_unfinished_requests()
    assert manager.num_free_blocks == manager.num_blocks
    assert all(block.ref_count == 0 for block in manager.pool.blocks.values())


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_failed_step_leaves_no_unwritten_kv_in_the_prefix_cache(tiny_dir, phase, backend, async_scheduling):
    """A step registers its full blocks' hashes before its forward writes their KV. When the forward
    raises, later prompts that share those blocks must not read the never-written KV: their outputs
    equal a fresh engine's. (With async scheduling a decode step registers its block once the step
    is queued; on the CPU the forward has run by then, so the decode case checks recovery only.)"""
    check_failed_step(tiny_dir, phase, dict(ARGS, attention_backend=backend, async_scheduling=async_scheduling))


@needs_cuda
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_failed_step_on_gpu(tiny_dir, phase, async_scheduling):
    """The same on the GPU path (Triton kernels, async scheduling over a CUDA stream); eager, so that
    decode runs the patched layer instead of replaying a CUDA graph."""
    args = dict(ARGS, device="cuda", dtype="float32", attention_backend="triton", enforce_eager=True,
                compile_small_ops=False, async_scheduling=async_scheduling)
    check_failed_step(tiny_dir, phase, args)


def check_failed_step(tiny_dir, phase, args):
    with LLM(tiny_dir, **args) as fresh, LLM(tiny_dir, **args) as faulty:
        poisoned(fresh)
        poisoned(faulty)
        if phase == "prefill":  # the failing prefill registered the two shared blocks
            failing = [SHARED + [3, 4], SHARED + [5], [9] * 9]
            later = [SHARED + [6], SHARED + [3, 4], [9] * 9 + [1]]
            fault = at_prefill
        else:  # the failing decode step writes position 7, whose token fills (and registers) block 0
            first = [7, 8, 9, 10, 11, 12]
            generated = fresh.generate([first], greedy(4), use_tqdm=False)[0].outputs[0].token_ids
            assert fresh.reset_prefix_cache()  # both engines then compute `later` from an empty cache
            failing = [first]
            later = [first + generated[:2] + [21, 22, 23], first + generated[:4]]
            fault = at_decode_of_position(7)
        with fault_in_last_layer(faulty, fault) as fired, pytest.raises(InjectedFault):
            faulty.generate(failing, greedy(4), use_tqdm=False)
        assert fired
        assert_all_blocks_free(faulty)
        assert token_ids(faulty.generate(later, greedy(4), use_tqdm=False)) == \
            token_ids(fresh.generate(later, greedy(4), use_tqdm=False))
        assert_all_blocks_free(faulty)


@pytest.mark.parametrize("exc", [InjectedFault, KeyboardInterrupt])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_interrupted_generate_leaves_the_engine_usable(tiny_dir, exc, async_scheduling):
    """An exception or Ctrl-C after some requests finished and others are mid-decode: everything is
    aborted, the blocks are freed, and the same call run again gives a fresh engine's outputs."""
    args = dict(ARGS, async_scheduling=async_scheduling)
    fresh, faulty = poisoned(LLM(tiny_dir, **args)), poisoned(LLM(tiny_dir, **args))
    prompts = [SHARED + [1], SHARED[:10], [5] * 12, SHARED + [2, 3]]
    params = [greedy(n) for n in (2, 12, 12, 12)]  # the first finishes before the fault
    with fault_in_last_layer(faulty, at_decode_of_position(len(SHARED) + 6), exc) as fired, pytest.raises(exc):
        faulty.generate(prompts, params, use_tqdm=False)
    assert fired
    assert_all_blocks_free(faulty)
    expected = token_ids(fresh.generate(prompts, params, use_tqdm=False))
    assert token_ids(faulty.generate(prompts, params, use_tqdm=False)) == expected
    assert_all_blocks_free(faulty)
