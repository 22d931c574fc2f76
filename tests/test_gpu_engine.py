"""The engine on a CUDA GPU: the Triton backend against the torch reference backend, CUDA graphs
against eager, chunked prefill against whole-prompt prefill, on the real Qwen3-0.6B shape in
bfloat16 (random weights). Skipped without CUDA."""
import gc
import random

import pytest
import torch

from benchmarks.common import teacher_forced_logits
from minivllm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ENGINE_ARGS = dict(dtype="bfloat16", max_model_len=2048, max_num_batched_tokens=8192, max_num_seqs=64,
                   gpu_memory_utilization=0.5)


@pytest.fixture(scope="module")
def qwen3_06b_dir():
    """Made once into the minivllm cache (the demo's checkpoint), then reused."""
    from minivllm.tools.make_model import make_model
    from minivllm.tools.tokenizer import minivllm_cache_dir

    return str(make_model("qwen3-0.6b", minivllm_cache_dir() / "random-qwen3-0.6b", seed=0))


def prompts(num=24, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(10000) for _ in range(rng.randint(1, 700))] for _ in range(num)]


def long_and_shared_prompts(seed):
    """16 prompts of 1-700 tokens, one of 3000, then three sharing a 700-token prefix (5, 300, 1000 more)."""
    rng = random.Random(seed)
    shared = [rng.randrange(10000) for _ in range(700)]
    return prompts(num=16, seed=seed) + [[rng.randrange(10000) for _ in range(3000)]] + [
        shared + [rng.randrange(10000) for _ in range(n)] for n in (5, 300, 1000)]


def assert_close_runs(ref, other, keys):
    """Two runs of (teacher-forced logits by key, greedy tokens per prompt) that compute in other orders
    in bfloat16: the logits at `keys` within 2% (relative norm), the first 8 tokens equal for 80% of prompts."""
    (ref_logits, ref_tokens), (logits, tokens) = ref, other
    for key in sorted(keys):
        rel = (ref_logits[key] - logits[key]).norm() / ref_logits[key].norm()
        assert rel < 2e-2, f"{key}: relative logits difference {rel:.3e}"
    agree = sum(r[:8] == t[:8] for r, t in zip(ref_tokens, tokens))
    assert agree >= 0.8 * len(ref_tokens), f"only {agree}/{len(ref_tokens)} prompts agree on the first 8 tokens"


def test_triton_backend_matches_torch_backend(qwen3_06b_dir):
    batch = prompts()
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(qwen3_06b_dir, attention_backend=backend, enforce_eager=True, **ENGINE_ARGS)
        logits = teacher_forced_logits(llm, batch)
        outs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        results[backend] = (logits, [o.outputs[0].token_ids for o in outs])
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    (ref_logits, ref_tokens), (tri_logits, tri_tokens) = results["torch"], results["triton"]
    assert ref_logits.keys() == tri_logits.keys()
    for key, a in ref_logits.items():
        rel = (a - tri_logits[key]).norm() / a.norm()
        assert rel < 2e-2, f"(step, prompt) {key}: relative logits difference {rel:.3e}"
    # Free-running greedy decoding may part at a near-tie (random weights, bf16): most prompts agree.
    agree = sum(r[:4] == t[:4] for r, t in zip(ref_tokens, tri_tokens))
    assert agree >= 0.8 * len(batch), f"only {agree}/{len(batch)} prompts agree on the first 4 tokens"


@pytest.mark.whole_gpu  # its engine's weights and activations took 4.7 GiB, over half a worker's 8.9 GiB share
def test_cuda_graph_replay_is_the_eager_forward(qwen3_06b_dir):
    """A decode step replayed from its captured graph computes exactly what the eager forward does on
    the same padded inputs (5 sequences in the graph of 8)."""
    from minivllm.core.attention import set_forward_context
    from minivllm.core.sequence import Sequence

    llm = LLM(qwen3_06b_dir, **{**ENGINE_ARGS, "max_prompt_graph_tokens": 0})
    runner, scheduler = llm.model_runner, llm.scheduler
    seqs = [Sequence(p, SamplingParams(temperature=0.0), llm.config.kvcache_block_size) for p in prompts(num=5, seed=3)]
    for seq in seqs:
        scheduler.add(seq)
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner.execute_model(out).sampled_token_ids)  # the prefill
    out = scheduler.schedule()
    assert not out.is_prefill and out.num_seqs == 5
    with torch.inference_mode():
        batch = runner.upload(runner.prepare_inputs(out))
        assert len(batch.input_ids) == 8 and 8 in runner.graphs.graphs
        replayed = runner.forward(batch).clone()
        with set_forward_context(batch.attn):  # stores the same K/V in the same slots again
            eager = runner.model(batch.input_ids, batch.positions)
    assert torch.equal(replayed[:5], eager[:5])
    llm.shutdown()


def test_cuda_graphs_match_eager(qwen3_06b_dir):
    """The engine with decode graphs (batches padded to a captured size) against the eager engine
    (no padding): other GEMM shapes and decode splits sum in other orders in bfloat16, so logits
    close, greedy tokens mostly equal. (Prompt steps run eagerly in both here.)"""
    batch = prompts(num=40, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    results = {}
    for eager in (True, False):
        llm = LLM(qwen3_06b_dir, enforce_eager=eager, **{**ENGINE_ARGS, "max_prompt_graph_tokens": 0})
        assert (getattr(llm.model_runner, "graphs", None) is None) == eager
        logits = teacher_forced_logits(llm, batch[:8], num_steps=8)
        results[eager] = (logits, [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)])
        llm.shutdown()
    assert_close_runs(results[True], results[False], results[True][0].keys())


PROMPT_GRAPH_CASES = {  # name -> (engine options, the kinds of prompt step that must go through the pieces)
    "whole prompts": (dict(enable_chunked_prefill=False), {"prefill", "prefix"}),
    # (mixed steps of at most 512 tokens run unified by default: engine/mixed_steps.py)
    "chunked": (dict(enable_chunked_prefill=True, max_num_batched_tokens=512), {"prefill", "prefix", "mixed_unified"}),
    "fp8 cache": (dict(kv_cache_dtype="fp8", calculate_kv_scales=True, enable_chunked_prefill=False),
                  {"prefill", "prefix"}),
}


@pytest.mark.whole_gpu  # Qwen3-0.6B, weights and activations 9.3 GiB: more than a worker's share of an H100
@pytest.mark.parametrize("case", list(PROMPT_GRAPH_CASES))
def test_prompt_step_graphs_match_eager(qwen3_06b_dir, case):
    """Prompt steps through the piecewise graphs (engine/prompt_graphs.py) against the same steps run
    eagerly: prompts of 1-700 tokens, three sharing a 700-token prefix (prefix hits), one of 3000 tokens
    (past the largest bucket: eager in both); with chunked prefill, chunks over cached prefixes and mixed
    steps of decodes and chunks; with an FP8 cache whose scales come from the first prefill (eager in
    both), the steps after it. The graphs pad a step to its bucket, so the GEMMs may pick other tilings
    than for the exact count: logits close, greedy tokens mostly equal."""
    options, kinds = PROMPT_GRAPH_CASES[case]
    batch = long_and_shared_prompts(seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results = {}
    for graph_tokens in (0, 2048):
        llm = LLM(qwen3_06b_dir, **{**ENGINE_ARGS, "max_model_len": 4096, "max_num_batched_tokens": 4096,
                                    "max_prompt_graph_tokens": graph_tokens, **options})
        pieces = getattr(llm.model_runner, "prompt_graphs", None)
        assert (pieces is None) == (graph_tokens == 0)
        logits = {}  # one prompt at a time, so that steps fit the buckets; the shared ones hit the cache
        for i, prompt in enumerate(batch[:3] + batch[-3:]):
            logits.update({(i, *key): row for key, row in teacher_forced_logits(llm, [prompt], num_steps=6).items()})
        outs = llm.generate(batch, params, use_tqdm=False)
        if pieces is not None:
            assert pieces.sizes[-1] == min(2048, llm.config.max_num_batched_tokens)
            assert kinds <= {kind for kind, n in pieces.steps_by_kind.items() if n}, pieces.steps_by_kind
        results[graph_tokens] = (logits, [o.outputs[0].token_ids for o in outs])
        llm.shutdown()
    assert results[0][0].keys() == results[2048][0].keys()
    assert_close_runs(results[0], results[2048], results[0][0].keys())


def test_chunked_prefill_matches_whole_prompts(qwen3_06b_dir):
    """Prompts up to 3000 tokens in 512-token chunks (mixed steps, chunks over paged prefixes,
    prefix hits ending mid-chunk) against whole-prompt prefill. In exact arithmetic the tokens are
    identical (the CPU tests check that); in bfloat16 the keys are summed in other tile orders, so
    the logits of the first steps must agree closely and greedy tokens must agree for most prompts."""
    batch = long_and_shared_prompts(seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    results = {}
    for chunked in (False, True):
        budget = dict(max_num_batched_tokens=512) if chunked else {}
        llm = LLM(qwen3_06b_dir, enable_chunked_prefill=chunked,
                  **{**ENGINE_ARGS, "max_model_len": 4096, "max_num_batched_tokens": 4096, **budget})
        logits = teacher_forced_logits(llm, batch[-4:], num_steps=12)  # the long prompt and the shared prefixes
        outs = llm.generate(batch, params, use_tqdm=False)
        results[chunked] = (logits, [o.outputs[0].token_ids for o in outs])
        llm.shutdown()
    common = results[False][0].keys() & results[True][0].keys()  # the chunked engine took more steps to reach some
    assert len(common) >= 8, sorted(common)
    assert_close_runs(results[False], results[True], common)


def test_unified_mixed_steps_match_split(qwen3_06b_dir):
    """Mixed steps whose decode rows run as 1-token chunks in the prefill kernel (unified) against
    the decode kernel (split), through the piecewise graphs: 512-token chunks beside decodes of many
    context lengths, chunks over paged prefixes and prefix hits. bfloat16 sums in other tile orders:
    logits close, greedy tokens mostly equal."""
    batch = long_and_shared_prompts(seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    results = {}
    for mode in ("split", "unified"):
        llm = LLM(qwen3_06b_dir, enable_chunked_prefill=True, mixed_step_attention=mode,
                  **{**ENGINE_ARGS, "max_model_len": 4096, "max_num_batched_tokens": 512})
        logits = teacher_forced_logits(llm, batch[-4:], num_steps=12)  # the long prompt and the shared prefixes
        outs = llm.generate(batch, params, use_tqdm=False)
        kinds = getattr(llm.model_runner, "prompt_graphs", None).steps_by_kind
        mixed, other = ("mixed", "mixed_unified") if mode == "split" else ("mixed_unified", "mixed")
        assert kinds[mixed] > 0 and kinds[other] == 0, kinds
        results[mode] = (logits, [o.outputs[0].token_ids for o in outs])
        llm.shutdown()
    assert results["split"][0].keys() == results["unified"][0].keys()
    assert_close_runs(results["split"], results["unified"], results["split"][0].keys())


@pytest.mark.whole_gpu
def test_kv_cache_sized_from_memory(qwen3_06b_dir):
    total = torch.cuda.get_device_properties(0).total_memory
    with LLM(qwen3_06b_dir, **{**ENGINE_ARGS, "gpu_memory_utilization": 0.3}) as llm:
        kv_bytes = llm.config.num_kvcache_blocks * llm.model_runner.kv_cache_block_bytes()
        assert 0.1 * total < kv_bytes < 0.3 * total
        # A second engine beside it gets its own budget (0.3 x total), and says what the first holds.
        with LLM(qwen3_06b_dir, **{**ENGINE_ARGS, "gpu_memory_utilization": 0.3}) as second:
            assert second.config.num_kvcache_blocks == pytest.approx(llm.config.num_kvcache_blocks, rel=0.05)
            held = float(second.model_runner.memory_report.split("other processes or engines hold ")[1].split(" GiB")[0])
            assert held * 2**30 > kv_bytes
    with pytest.raises(ValueError, match="needs"):
        LLM(qwen3_06b_dir, **{**ENGINE_ARGS, "max_model_len": 40960, "max_num_batched_tokens": 40960,
                               "gpu_memory_utilization": 0.02})


def engine_memory_is_given_back(make_engine):
    """Build an engine with make_engine(), generate, release it; the allocator is back to its start."""
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()  # cuBLAS's per-process workspace exists before we count
    del a
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    released = make_engine()
    gc.collect()
    torch.cuda.empty_cache()
    return before, torch.cuda.memory_allocated(), released


@pytest.mark.whole_gpu  # in a shared run a worker's share (8.9 GiB) did not hold the second engine's 9.4 GiB
@pytest.mark.parametrize("release", ["shutdown", "context_manager", "garbage_collection"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_engine_gives_its_memory_back(qwen3_06b_dir, release, enforce_eager):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    batch = prompts(num=8, seed=2)

    def make_engine():
        if release == "context_manager":
            with LLM(qwen3_06b_dir, enforce_eager=enforce_eager, **ENGINE_ARGS) as llm:
                llm.generate(batch, params, use_tqdm=False)
                assert torch.cuda.memory_allocated() > llm.model_runner.kv_cache.numel()
            return llm
        llm = LLM(qwen3_06b_dir, enforce_eager=enforce_eager, **ENGINE_ARGS)
        assert (getattr(llm.model_runner, "graphs", None) is None) == enforce_eager
        llm.generate(batch, params, use_tqdm=False)
        if release == "shutdown":
            llm.shutdown()
            llm.shutdown()  # idempotent
            return llm
        del llm  # garbage collection
        return None

    before, after, llm = engine_memory_is_given_back(make_engine)
    assert after == before, f"{(after - before) / 2**20:.1f} MiB still allocated"
    if llm is not None:
        with pytest.raises(RuntimeError, match="shut down"):
            llm.generate(batch, params, use_tqdm=False)


@pytest.mark.whole_gpu
def test_engines_one_after_another_get_the_same_cache(qwen3_06b_dir):
    """Re-running a notebook cell that builds an LLM: the new engine is sized like the first."""
    sizes = []
    for _ in range(2):
        llm = LLM(qwen3_06b_dir, **{**ENGINE_ARGS, "gpu_memory_utilization": 0.9})
        sizes.append(llm.config.num_kvcache_blocks)
        out = llm.generate(prompts(num=2), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 4 for o in out)
        llm = None  # dropped without shutdown(): garbage collection releases it
    assert sizes[1] == pytest.approx(sizes[0], rel=0.02)
