"""The two ways a mixed step (decode rows + prompt chunks) attends: split (decode rows through the
decode kernel, chunks through the prefill kernel) and unified (decode rows as 1-token chunks in the
chunks' one prefill launch; engine/model_runner.py, UNIFIED_MIXED_MAX_TOKENS). On CPU in float32 both
must give the tokens of whole-prompt prefill exactly, on the torch references and on the Triton
kernels (interpreter); the unified packing is checked row by row against the split one."""
import numpy as np
import pytest
import torch
from conftest_kernels import needs_interpreter
from test_chunked_prefill import ENGINE_ARGS, UNCHUNKED, generate_in_two_rounds, greedy, random_prompts

from benchmarks.common import teacher_forced_logits
from minivllm import LLM
from minivllm.engine.model_runner import MIXED_ATTENTION_ENV, UNIFIED_MIXED_MAX_TOKENS
from minivllm.engine.scheduler import SchedulerOutput
from minivllm.engine.sequence import Sequence

CHUNKED = dict(enable_chunked_prefill=True, max_num_batched_tokens=20)  # 20: chunks end mid-block (16)


def mixed_workload():
    """Round one: the prompt whose first 40 tokens the last prompt shares (its first two blocks
    come from the prefix cache, and its prompt then ends mid-block). Round two: short prompts that
    decode, with contexts of different lengths, while a long one is prefilled in chunks beside them."""
    shared = random_prompts([40], seed=1)[0]
    prompts = [shared + [5, 6, 7]] + random_prompts([3, 9, 14, 70], seed=3) + [shared + random_prompts([13], seed=2)[0]]
    return prompts, [greedy(8) for _ in prompts]


def record_packing(llm):
    """Wrap the runner's prepare_prefill: every mixed step's (decode contexts, unified metadata,
    split metadata and inputs), the split one packed from the same sequences at the same moment."""
    runner, steps = llm.model_runner, []
    prepare = runner.prepare_prefill

    def recording(seqs, num_scheduled_tokens=None, num_decodes=0, use_cache=True, unified=False):
        result = prepare(seqs, num_scheduled_tokens, num_decodes, use_cache, unified)
        if num_decodes:
            split = prepare(seqs, num_scheduled_tokens, num_decodes, use_cache, unified=False)
            steps.append(([seq.num_tokens for seq in seqs[:num_decodes]], unified, result, split))
        return result
    runner.prepare_prefill = recording
    return steps


@pytest.fixture
def mixed_attention(monkeypatch):
    """set(mode): the mixed-step rule of the engines built from now on."""
    return lambda mode: monkeypatch.setenv(MIXED_ATTENTION_ENV, mode)


def run(model_dir, prompts, params, **args):
    llm = LLM(model_dir, **{**ENGINE_ARGS, **args})
    steps = record_packing(llm)
    trace = llm.start_step_trace()
    results = generate_in_two_rounds(llm, prompts, params)
    assert results[-1].num_cached_tokens == 32  # the shared prompt's first two blocks
    assert llm.scheduler.block_manager.num_free_blocks == llm.config.num_kvcache_blocks
    return [o.outputs[0].token_ids for o in results], steps, [r.kind for r in trace.records], llm


def test_unified_and_split_give_the_tokens_of_whole_prompts(qwen3_tiny_dir, mixed_attention):
    """Greedy tokens equal to whole-prompt prefill's in every mode, and the logits of the same
    teacher-forced steps (mixed ones among them) equal to float32 rounding between the modes."""
    prompts, params = mixed_workload()
    reference, *_ = run(qwen3_tiny_dir, prompts, params, **UNCHUNKED)
    kinds_by_mode, logits_by_mode = {}, {}
    for mode in ("split", "unified", "auto"):
        mixed_attention(mode)
        outputs, steps, kinds, llm = run(qwen3_tiny_dir, prompts, params, **CHUNKED)
        assert outputs == reference, mode
        num_steps = len(steps)
        logits_by_mode[mode] = teacher_forced_logits(llm, prompts[1:], num_steps=10)  # the last one hits the cache
        assert len(steps) > num_steps, "no mixed step among the teacher-forced ones"
        assert llm.model_runner.mixed_attention == mode
        assert steps and all(unified == (mode != "split") for _, unified, _, _ in steps), mode  # auto: 20 <= 512
        # a mixed step with several decode rows of different context lengths
        assert any(len(set(contexts)) >= 3 for contexts, *_ in steps), [contexts for contexts, *_ in steps]
        kinds_by_mode[mode] = set(kinds)
    assert {"mixed", "mixed_unified"} & kinds_by_mode["split"] == {"mixed"}
    assert {"mixed", "mixed_unified"} & kinds_by_mode["unified"] == {"mixed_unified"}
    split = logits_by_mode["split"]
    for mode in ("unified", "auto"):
        assert logits_by_mode[mode].keys() == split.keys()
        for key, row in split.items():
            torch.testing.assert_close(logits_by_mode[mode][key], row, atol=1e-4, rtol=1e-4, msg=f"{mode} {key}")


def test_unified_packing_is_decode_rows_as_one_token_chunks(qwen3_tiny_dir, mixed_attention):
    """Row by row: the unified metadata has no decode part, cu_seqlens_q steps by 1 over the decode
    rows, their cu_seqlens_k steps are their contexts (the split packing's context_lens), and they
    read their prefix through block tables equal to the split packing's; the chunks' part is the
    split packing's, shifted by the decode rows; the inputs and slots are the same."""
    mixed_attention("unified")
    prompts, params = mixed_workload()
    _, steps, _, llm = run(qwen3_tiny_dir, prompts, params, **CHUNKED)
    assert any(len(contexts) >= 3 for contexts, *_ in steps)
    for contexts, unified, (ids, positions, meta), (split_ids, split_positions, split) in steps:
        d = len(contexts)
        assert unified and meta.num_decode_tokens == 0 and meta.decode is None and meta.num_unified_decodes == d
        assert split.num_decode_tokens == d and split.num_unified_decodes == 0
        cu_q, cu_k = meta.cu_seqlens_q.tolist(), meta.cu_seqlens_k.tolist()
        assert cu_q[:d + 1] == list(range(d + 1))  # one query row per decode
        assert np.diff(cu_k[:d + 1]).tolist() == contexts == split.decode.context_lens.tolist()
        assert [q - d for q in cu_q[d:]] == split.cu_seqlens_q.tolist()
        assert [k - cu_k[d] for k in cu_k[d:]] == split.cu_seqlens_k.tolist()
        assert meta.block_tables[:d].equal(split.decode.block_tables)
        if split.block_tables is not None:  # some chunk continues a cached prefix
            assert meta.block_tables[d:].equal(split.block_tables)
        assert positions[:d].tolist() == [n - 1 for n in contexts]
        assert ids.equal(split_ids) and positions.equal(split_positions)
        assert meta.slot_mapping.equal(split.slot_mapping)
        assert meta.max_seqlen_q == max(np.diff(cu_q)) and meta.max_seqlen_k == max(np.diff(cu_k))
    assert llm.stats.num_decode_tokens > 0


def test_which_steps_are_unified(qwen3_tiny_dir, mixed_attention):
    """auto: mixed steps of at most UNIFIED_MIXED_MAX_TOKENS tokens; never a prefill-only or decode-only
    step; an unknown rule is refused when the engine is built."""
    def step(num_decodes, chunk):
        seqs = [Sequence([1, 2]) for _ in range(num_decodes)] + [Sequence([1] * chunk)]
        return SchedulerOutput(seqs, [1] * num_decodes + [chunk], num_decodes, seqs)

    decide = {}
    for mode in ("split", "unified", "auto"):
        mixed_attention(mode)
        runner = LLM(qwen3_tiny_dir, **ENGINE_ARGS, **CHUNKED).model_runner
        decide[mode] = [runner.is_unified_mixed_step(out) for out in (
            step(4, UNIFIED_MIXED_MAX_TOKENS - 4), step(4, UNIFIED_MIXED_MAX_TOKENS - 3), step(0, 10),
            SchedulerOutput.decodes([Sequence([1, 2])]))]
    assert decide == {"split": [False] * 4, "unified": [True, True, False, False], "auto": [True, False, False, False]}
    mixed_attention("both")
    with pytest.raises(ValueError, match="MINIVLLM_MIXED_ATTENTION='both'"):
        LLM(qwen3_tiny_dir, **ENGINE_ARGS, **CHUNKED)


@needs_interpreter
def test_triton_unified_and_split_match_unchunked(tmp_path, mixed_attention):
    """The Triton kernels (interpreter, float32): decode rows through the prefill kernel as 1-token
    chunks over paged prefixes of different lengths, and through the decode kernel."""
    from minivllm.tools.make_model import make_model

    tiny = make_model({"preset": "qwen3-tiny", "num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256,
                       "num_attention_heads": 4, "num_key_value_heads": 2}, tmp_path / "m")
    shared = random_prompts([36], seed=5)[0]
    prompts = [shared + [3, 4], random_prompts([45], seed=6)[0], [9] * 5, [8] * 11, shared + [5, 6, 7]]
    params = [greedy(4) for _ in prompts]
    args = dict(attention_backend="triton", max_model_len=128)
    reference, *_ = run(str(tiny), prompts, params, **args, **UNCHUNKED)
    for mode in ("split", "unified"):
        mixed_attention(mode)
        outputs, steps, _, _ = run(str(tiny), prompts, params, **args, **CHUNKED)
        assert outputs == reference, mode
        assert any(len(set(contexts)) >= 2 for contexts, *_ in steps), [contexts for contexts, *_ in steps]
        assert all(unified == (mode == "unified") for _, unified, _, _ in steps)
