"""The two ways a mixed step (decode rows + prompt chunks) attends: unified (the core's way: decode
rows as 1-token chunks in one prefill launch) and split (engine/mixed_steps.py: decode rows through
the decode kernel, chunks through the prefill kernel). On CPU in float32 both must give the tokens
of whole-prompt prefill exactly, on the torch references and on the Triton kernels (interpreter);
the split metadata is checked row by row against the unified one."""
import numpy as np
import pytest
import torch
from conftest_kernels import needs_interpreter
from test_chunked_prefill import ENGINE_ARGS, UNCHUNKED, generate_in_two_rounds, greedy, random_prompts

from benchmarks.common import teacher_forced_logits
from minivllm import LLM
from minivllm.core.scheduler import SchedulerOutput
from minivllm.core.sequence import Sequence
from minivllm.engine.mixed_steps import UNIFIED_MIXED_MAX_TOKENS, SplitMixedMetadata

CHUNKED = dict(enable_chunked_prefill=True, max_num_batched_tokens=20)  # 20: chunks end mid-block (16)


def mixed_workload():
    """Round one: the prompt whose first 40 tokens the last prompt shares (its first two blocks
    come from the prefix cache, and its prompt then ends mid-block). Round two: short prompts that
    decode, with contexts of different lengths, while a long one is prefilled in chunks beside them."""
    shared = random_prompts([40], seed=1)[0]
    prompts = [shared + [5, 6, 7]] + random_prompts([3, 9, 14, 70], seed=3) + [shared + random_prompts([13], seed=2)[0]]
    return prompts, [greedy(8) for _ in prompts]


def record_mixed_steps(llm):
    """Wrap the runner's upload: every mixed step's (decode contexts, its metadata, the core's
    unified metadata of the same inputs)."""
    from minivllm.core.model_runner import ModelRunner

    runner, steps = llm.model_runner, []
    upload = runner.upload

    def recording(inputs):
        batch = upload(inputs)
        if inputs.is_prefill and inputs.num_decodes:
            contexts = np.diff(inputs.cu_seqlens_k[:inputs.num_decodes + 1]).tolist()
            steps.append((contexts, batch.attn, ModelRunner.upload(runner, inputs).attn, batch))
        return batch
    runner.upload = recording
    return steps


def run(model_dir, prompts, params, **args):
    llm = LLM(model_dir, **{**ENGINE_ARGS, **args})
    steps = record_mixed_steps(llm)
    trace = llm.start_step_trace()
    results = generate_in_two_rounds(llm, prompts, params)
    assert results[-1].num_cached_tokens == 32  # the shared prompt's first two blocks
    assert llm.scheduler.kv_cache_manager.num_free_blocks == llm.config.num_kvcache_blocks
    return [o.outputs[0].token_ids for o in results], steps, [r.kind for r in trace.records], llm


def test_unified_and_split_give_the_tokens_of_whole_prompts(qwen3_tiny_dir):
    """Greedy tokens equal to whole-prompt prefill's in every mode, and the logits of the same
    teacher-forced steps (mixed ones among them) equal to float32 rounding between the modes."""
    prompts, params = mixed_workload()
    reference, *_ = run(qwen3_tiny_dir, prompts, params, **UNCHUNKED)
    kinds_by_mode, logits_by_mode = {}, {}
    for mode in ("split", "unified", "auto"):
        outputs, steps, kinds, llm = run(qwen3_tiny_dir, prompts, params, **CHUNKED, mixed_step_attention=mode)
        assert outputs == reference, mode
        num_steps = len(steps)
        logits_by_mode[mode] = teacher_forced_logits(llm, prompts[1:], num_steps=10)  # the last one hits the cache
        assert len(steps) > num_steps, "no mixed step among the teacher-forced ones"
        split = [isinstance(attn, SplitMixedMetadata) for _, attn, _, _ in steps]
        assert steps and all(s == (mode == "split") for s in split), mode  # auto: 20 tokens <= 512
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


def test_split_metadata_is_the_unified_one_cut_in_two(qwen3_tiny_dir):
    """Row by row: the unified metadata steps cu_seqlens_q by 1 over the decode rows and their
    cu_seqlens_k by their contexts; the split metadata's decode part has those contexts and block
    tables, and its chunk part is the unified one's rest, shifted; the slots are the whole step's."""
    prompts, params = mixed_workload()
    _, steps, _, llm = run(qwen3_tiny_dir, prompts, params, **CHUNKED, mixed_step_attention="split")
    assert any(len(contexts) >= 3 for contexts, *_ in steps)
    for contexts, split, unified, batch in steps:
        d = len(contexts)
        assert isinstance(split, SplitMixedMetadata) and split.num_decode_tokens == d
        cu_q, cu_k = unified.cu_seqlens_q.tolist(), unified.cu_seqlens_k.tolist()
        assert cu_q[:d + 1] == list(range(d + 1))  # one query row per decode
        assert np.diff(cu_k[:d + 1]).tolist() == contexts == split.decode.context_lens.tolist()
        assert [q - d for q in cu_q[d:]] == split.cu_seqlens_q.tolist()
        assert [k - cu_k[d] for k in cu_k[d:]] == split.cu_seqlens_k.tolist()
        assert unified.block_tables[:d].equal(split.decode.block_tables)
        if split.block_tables is not None:  # some chunk continues a cached prefix
            assert unified.block_tables[d:].equal(split.block_tables)
        assert batch.positions[:d].tolist() == [n - 1 for n in contexts]
        assert unified.slot_mapping.equal(split.slot_mapping)
        assert split.max_seqlen_q == max(np.diff(split.cu_seqlens_q.tolist()))
        assert split.max_seqlen_k == max(np.diff(split.cu_seqlens_k.tolist()))
    assert llm.stats.num_decode_tokens > 0


def test_which_steps_are_unified(qwen3_tiny_dir):
    """auto: mixed steps of at most UNIFIED_MIXED_MAX_TOKENS tokens; split: none; unified: the core's
    way, no layer; an unknown rule is refused when the engine is built."""
    def step(num_decodes, chunk):
        seqs = [Sequence([1, 2]) for _ in range(num_decodes)] + [Sequence([1] * chunk)]
        return SchedulerOutput(seqs, [1] * num_decodes + [chunk], num_decodes, seqs)

    decide = {}
    for mode in ("split", "auto"):
        runner = LLM(qwen3_tiny_dir, **ENGINE_ARGS, **CHUNKED, mixed_step_attention=mode).model_runner
        decide[mode] = [runner.is_unified_mixed_step(out) for out in (
            step(4, UNIFIED_MIXED_MAX_TOKENS - 4), step(4, UNIFIED_MIXED_MAX_TOKENS - 3))]
    assert decide == {"split": [False, False], "auto": [True, False]}
    unified = LLM(qwen3_tiny_dir, **ENGINE_ARGS, **CHUNKED, mixed_step_attention="unified").model_runner
    assert not hasattr(unified, "is_unified_mixed_step")  # the layer is not there
    with pytest.raises(ValueError, match="mixed_step_attention must be one of"):
        LLM(qwen3_tiny_dir, **ENGINE_ARGS, **CHUNKED, mixed_step_attention="both")


@needs_interpreter
def test_triton_unified_and_split_match_unchunked(tmp_path):
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
        outputs, steps, _, _ = run(str(tiny), prompts, params, **args, **CHUNKED, mixed_step_attention=mode)
        assert outputs == reference, mode
        assert any(len(set(contexts)) >= 2 for contexts, *_ in steps), [contexts for contexts, *_ in steps]
        assert all(isinstance(attn, SplitMixedMetadata) == (mode == "split") for _, attn, _, _ in steps)
