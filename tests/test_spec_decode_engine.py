"""Speculative decoding in the engine (engine/spec_decode.py): greedy outputs token for token the same
with and without drafts, over copy-heavy and random prompts, preemption, prefix hits, chunked
prefill, stop strings, EOS and max_tokens inside a draft, n = 2; the sampled path; metrics; bad
configs. CPU, float32, torch attention (and one run on the Triton interpreter)."""
import json
import pathlib
import random

import pytest

from conftest_kernels import needs_interpreter
from minivllm import LLM, SamplingParams

ENGINE_ARGS = dict(device="cpu", max_model_len=256, max_num_batched_tokens=1024, max_num_seqs=8, kvcache_block_size=8)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def copy_heavy_prompts(num: int, seed: int = 1) -> list[list[int]]:
    """A random segment repeated (what prompt lookup is for), and a random prompt."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(8, 20))] * rng.randint(2, 4) for _ in range(num - 1)]
    return prompts + [[rng.randrange(1000) for _ in range(37)]]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def generate(model_dir, prompts, params, spec=None, check=None, **kwargs):
    """(token ids, finish reason, text) per prompt; check(llm) runs before shutdown."""
    with LLM(model_dir, **{**ENGINE_ARGS, **kwargs}, speculative_config=spec) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.scheduler.kv_cache_manager.num_free_blocks == llm.config.num_kvcache_blocks
        if check is not None:
            check(llm)
    return [[(c.token_ids, c.finish_reason, c.text) for c in o.outputs] for o in outputs]


def spec_stats(llm):
    return llm.scheduler.spec_stats


def assert_same_with_drafts(model_dir, prompts, params, min_accepted=1, **kwargs):
    """The outputs with n-gram drafts equal those without; drafts were accepted."""
    def check(llm):
        stats = spec_stats(llm)
        assert stats.num_accepted_tokens >= min_accepted, stats
        check.stats = stats
    plain = generate(model_dir, prompts, params, **kwargs)
    assert generate(model_dir, prompts, params, NGRAM, check, **kwargs) == plain
    return check.stats


def test_greedy_same_tokens_copy_heavy_and_random(qwen3_tiny_dir, llama_tiny_dir):
    prompts = copy_heavy_prompts(6)
    for model_dir in (qwen3_tiny_dir, llama_tiny_dir):
        stats = assert_same_with_drafts(model_dir, prompts, greedy(40), min_accepted=20)
        assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens <= stats.num_draft_tokens
        assert stats.num_accepted_tokens_per_pos == sorted(stats.num_accepted_tokens_per_pos, reverse=True)


def test_greedy_same_tokens_under_preemption(qwen3_tiny_dir):
    def preempted(llm):
        assert llm.scheduler.num_preemptions > 0
    prompts = copy_heavy_prompts(6, seed=2)
    args = dict(num_kvcache_blocks=30, max_model_len=128)
    plain = generate(qwen3_tiny_dir, prompts, greedy(60), **args)
    assert generate(qwen3_tiny_dir, prompts, greedy(60), NGRAM, preempted, **args) == plain


def test_greedy_same_tokens_with_prefix_hits_and_chunked_prefill(qwen3_tiny_dir):
    shared = copy_heavy_prompts(2, seed=3)[0]
    prompts = [shared + p for p in copy_heavy_prompts(5, seed=4)]

    def hits(llm):
        assert llm.scheduler.kv_cache_manager.num_cached_tokens_hit > 0
    plain = generate(qwen3_tiny_dir, prompts, greedy(30), max_num_batched_tokens=24)
    assert generate(qwen3_tiny_dir, prompts, greedy(30), NGRAM, hits, max_num_batched_tokens=24) == plain
    # no chunked prefill: whole-prompt steps, then decode steps with drafts
    assert_same_with_drafts(qwen3_tiny_dir, prompts, greedy(30), enable_chunked_prefill=False)


def test_eos_stop_tokens_and_max_tokens_inside_a_draft(qwen3_tiny_dir):
    """A stop token or max_tokens reached part-way through an accepted draft ends the sequence
    there: the same tokens and finish reasons as one token per step."""
    prompts = copy_heavy_prompts(5, seed=5)
    reference = generate(qwen3_tiny_dir, prompts, greedy(40))
    # stop at the token each sequence makes 7th, and odd max_tokens that end inside drafts
    params = [greedy(40, stop_token_ids=[r[0][0][6]]) for r in reference] + [greedy(n) for n in (1, 2, 3, 5, 9)]
    assert_same_with_drafts(qwen3_tiny_dir, prompts + prompts, params)
    outputs = generate(qwen3_tiny_dir, prompts, params[:len(prompts)], NGRAM)
    assert all(o[0][1] == "stop" and len(o[0][0]) <= 7 for o in outputs)
    # EOS itself: the model's eos_token_id set to a token the sequences make
    eos = reference[0][0][0][10]
    assert_same_with_drafts(qwen3_tiny_dir, prompts, SamplingParams(temperature=0.0, max_tokens=40),
                            eos_token_id=eos, min_accepted=0)


def test_stop_strings_cut_at_the_same_token(qwen3_tiny_dir):
    """A stop string completed by a token in the middle of an accepted draft: the sequence ends
    with that token and the text is cut, as without drafts."""
    prompts = copy_heavy_prompts(4, seed=6)
    reference = generate(qwen3_tiny_dir, prompts, greedy(40))
    # the first quarter of each text: it first appears complete some tokens in (the texts repeat)
    params = [greedy(40, stop=[text[:len(text) // 4]]) for (_, _, text), in reference]
    with_stops = assert_same_with_drafts(qwen3_tiny_dir, prompts, params)
    assert with_stops.num_drafts > 0
    outputs = generate(qwen3_tiny_dir, prompts, params, NGRAM)
    assert all(o[0][1] == "stop" and 1 < len(o[0][0]) < 40 for o in outputs)


def test_n_equals_2_and_top_k_1_sampling_match_greedy(qwen3_tiny_dir):
    """n = 2 greedy: two identical samples. Temperature 0.8 with top_k = 1 goes through the
    rejection rule (p is one-hot on the argmax): exactly the greedy tokens."""
    prompts = copy_heavy_prompts(4, seed=7)
    assert_same_with_drafts(qwen3_tiny_dir, prompts, greedy(30, n=2))
    reference = generate(qwen3_tiny_dir, prompts, greedy(30))
    sampled = generate(qwen3_tiny_dir, prompts, SamplingParams(temperature=0.8, top_k=1, max_tokens=30,
                                                               ignore_eos=True), NGRAM)
    assert sampled == reference


def test_sampled_rows_and_rows_without_drafts_share_a_step(qwen3_tiny_dir):
    """Sampled drafted rows (seeded, penalised, top-p) next to greedy ones and to a row below
    min_tokens (no drafts): greedy rows keep plain decoding's tokens, the others stay in the vocabulary."""
    prompts = copy_heavy_prompts(6, seed=8)
    params = [SamplingParams(temperature=0.7, max_tokens=24, seed=i, ignore_eos=True) for i in range(2)]
    params += [SamplingParams(temperature=0.7, max_tokens=24, presence_penalty=0.5, repetition_penalty=1.2, seed=9,
                              ignore_eos=True)]
    params += [SamplingParams(temperature=0.7, top_p=0.9, max_tokens=24, min_tokens=20, ignore_eos=True),
               greedy(24), greedy(24)]

    def drafted(llm):
        assert spec_stats(llm).num_drafts > 0
    plain = generate(qwen3_tiny_dir, prompts, params)
    with_drafts = generate(qwen3_tiny_dir, prompts, params, NGRAM, drafted)
    assert with_drafts[4:] == plain[4:]
    vocab_size = json.loads((pathlib.Path(qwen3_tiny_dir) / "config.json").read_text())["vocab_size"]
    for output in with_drafts[:4]:
        assert len(output[0][0]) == 24 and all(0 <= t < vocab_size for t in output[0][0])


def logprob_outputs(model_dir, prompts, params, spec=None, check=None):
    """(token ids, [(token id, logprob, rank) of each position's entries], cumulative logprob) per prompt."""
    with LLM(model_dir, **ENGINE_ARGS, speculative_config=spec) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if check is not None:
            check(llm)
    return [(c.token_ids, [sorted((t, lp.logprob, lp.rank) for t, lp in position.items()) for position in c.logprobs or []],
             c.cumulative_logprob) for o in outputs for c in o.outputs]


def test_penalties_and_logprobs_keep_their_meaning_with_drafts(qwen3_tiny_dir):
    """Penalised and logprob-asking greedy requests draft: the same tokens as plain decoding, the
    same logprobs (top-k ids and ranks exactly, values to float32 rounding), EOS or max_tokens inside a draft."""
    prompts = copy_heavy_prompts(5, seed=13)
    params = [greedy(30, logprobs=3), greedy(30, logprobs=0, repetition_penalty=1.05), greedy(30, frequency_penalty=0.2),
              greedy(30, presence_penalty=0.3, logprobs=2), SamplingParams(temperature=0.0, max_tokens=23, logprobs=1)]

    def accepted(llm):
        assert spec_stats(llm).num_accepted_tokens >= 10, spec_stats(llm)
    plain = logprob_outputs(qwen3_tiny_dir, prompts, params)
    with_drafts = logprob_outputs(qwen3_tiny_dir, prompts, params, NGRAM, accepted)
    for (ids, entries, total), (ids_d, entries_d, total_d), p in zip(plain, with_drafts, params):
        assert ids_d == ids
        if p.logprobs is None:
            assert entries_d == [] and entries == []
            continue
        assert len(entries_d) == len(ids)
        for position, position_d in zip(entries, entries_d):
            assert [(t, rank) for t, _, rank in position_d] == [(t, rank) for t, _, rank in position]
            assert [lp for _, lp, _ in position_d] == pytest.approx([lp for _, lp, _ in position], abs=1e-4)
        assert total_d == pytest.approx(total, abs=1e-3)


def test_seeded_requests_draft_and_reproduce_whatever_their_batch(qwen3_tiny_dir):
    """A seeded sampled request carries drafts and its tokens depend on its seed alone: alone, or
    in another order among other requests, it emits the same tokens."""
    prompts = copy_heavy_prompts(4, seed=14)
    params = [SamplingParams(temperature=0.1, max_tokens=24, seed=100 + i, ignore_eos=True) for i in range(3)]
    params.append(SamplingParams(temperature=0.1, max_tokens=24, ignore_eos=True))  # unseeded

    # a draft model proposes every step (prompt lookup rarely matches a sampled continuation); the
    # random model's logits are nearly flat: at temperature 0.1 some drafts are kept, some rejected
    spec = {"method": "draft_model", "model": qwen3_tiny_dir, "num_speculative_tokens": 3}

    def accepted(llm):
        stats = spec_stats(llm)
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats  # some drafts rejected, some kept
    together = generate(qwen3_tiny_dir, prompts, params, spec, accepted)
    reordered = generate(qwen3_tiny_dir, prompts[::-1], params[::-1], spec)[::-1]
    alone = [generate(qwen3_tiny_dir, [prompts[i]], params[i], spec)[0] for i in range(3)]
    assert together[:3] == reordered[:3] == alone


def test_get_metrics_has_vllm_spec_decode_names(qwen3_tiny_dir):
    with LLM(qwen3_tiny_dir, **ENGINE_ARGS, speculative_config=NGRAM) as llm:
        llm.generate([{"prompt_token_ids": p} for p in copy_heavy_prompts(3)], greedy(20), use_tqdm=False)
        metrics = {m.name: m for m in llm.get_metrics()}
        stats = spec_stats(llm)
    assert metrics["vllm:spec_decode_num_drafts"].value == stats.num_drafts > 0
    assert metrics["vllm:spec_decode_num_draft_tokens"].value == stats.num_draft_tokens
    assert metrics["vllm:spec_decode_num_accepted_tokens"].value == stats.num_accepted_tokens > 0
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    assert len(per_pos) == 4 and sum(per_pos) == stats.num_accepted_tokens
    assert metrics["vllm:num_requests_running"].value == 0
    with LLM(qwen3_tiny_dir, **ENGINE_ARGS) as llm:
        assert not any(m.name.startswith("vllm:spec_decode") for m in llm.get_metrics())


def test_step_trace_records_each_steps_accepted_drafts(qwen3_tiny_dir):
    """The step trace's per-step draft and acceptance counts add up to the engine's counters, a
    step accepts at most its drafts, and the summary reports the acceptance length."""
    from minivllm.engine.step_trace import summarize

    with LLM(qwen3_tiny_dir, **ENGINE_ARGS, speculative_config=NGRAM) as llm:
        llm.start_step_trace()
        llm.generate([{"prompt_token_ids": p} for p in copy_heavy_prompts(3)], greedy(20), use_tqdm=False)
        records, stats = llm.step_trace.take(), spec_stats(llm)
    drafted = [r for r in records if r["num_drafted_seqs"]]
    assert drafted and all(r["kind"] == "decode" for r in drafted)
    assert sum(r["num_drafted_seqs"] for r in records) == stats.num_drafts
    assert sum(r["num_draft_tokens"] for r in records) == stats.num_draft_tokens
    assert sum(r["num_accepted_tokens"] for r in records) == stats.num_accepted_tokens > 0
    assert all(0 <= r["num_accepted_tokens"] <= r["num_draft_tokens"] <= 4 * r["num_drafted_seqs"] for r in records)
    assert f"acceptance length {stats.mean_acceptance_length:.2f}" in summarize(records)


def test_step_trace_times_the_proposer(qwen3_tiny_dir):
    """Each drafted step records the proposer's host time (a draft model's forwards), a part of the
    step's host time; prompt steps, which never draft, record none."""
    with LLM(qwen3_tiny_dir, **ENGINE_ARGS, speculative_config=draft_spec(qwen3_tiny_dir)) as llm:
        llm.start_step_trace()
        llm.generate([{"prompt_token_ids": p} for p in copy_heavy_prompts(3)], greedy(12), use_tqdm=False)
        records = llm.step_trace.take()
    drafted = [r for r in records if r["num_drafted_seqs"]]
    assert drafted and all(0 < r["propose_ms"] <= r["host_ms"] for r in drafted)
    assert all(r["propose_ms"] == 0 for r in records if r["kind"] == "prefill")


def test_drafts_off_above_disable_by_batch_size(qwen3_tiny_dir):
    prompts = copy_heavy_prompts(6, seed=9)
    spec = {**NGRAM, "disable_by_batch_size": 2}

    def no_drafts(llm):
        assert spec_stats(llm).num_drafts == 0
    plain = generate(qwen3_tiny_dir, prompts, greedy(12))
    assert generate(qwen3_tiny_dir, prompts, greedy(12), spec, no_drafts, max_num_seqs=6) == plain


@pytest.mark.parametrize("spec, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model: the draft's local directory"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "."}, "model is for method 'draft_model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "verify": "tree"}, "verify must be one of"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an int >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "must not exceed prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown speculative_config keys"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_configs_are_clear_errors(qwen3_tiny_dir, spec, message):
    with pytest.raises(ValueError, match=message):
        LLM(qwen3_tiny_dir, **ENGINE_ARGS, speculative_config=spec)


def test_both_verify_paths_and_async_scheduling_give_the_same_tokens(qwen3_tiny_dir, monkeypatch):
    """A step of decodes verifies as decode rows (one per drafted position) or as a prefill-style
    step: the same tokens. With async scheduling, steps above disable_by_batch_size run one ahead
    (placeholders) and steps with drafts wait for their tokens: the same tokens again."""
    from minivllm.engine import spec_decode

    rows_made = []
    original = spec_decode.decode_rows
    monkeypatch.setattr(spec_decode, "decode_rows", lambda seqs, drafts: rows_made.append(1) or original(seqs, drafts))
    prompts = copy_heavy_prompts(6, seed=12)
    plain = generate(qwen3_tiny_dir, prompts, greedy(30))

    def accepted(llm):
        assert spec_stats(llm).num_accepted_tokens > 0
    assert generate(qwen3_tiny_dir, prompts, greedy(30), {**NGRAM, "verify": "prefill"}, accepted) == plain
    assert not rows_made
    assert generate(qwen3_tiny_dir, prompts, greedy(30), {**NGRAM, "verify": "decode"}, accepted) == plain
    assert rows_made
    # 6 prompts ending after 10..35 tokens, drafts only at <= 3 decoding sequences: the first steps
    # run ahead, the last ones draft
    params = [greedy(10 + 5 * i) for i in range(len(prompts))]
    spec = {**NGRAM, "disable_by_batch_size": 3}
    assert generate(qwen3_tiny_dir, prompts, params, spec, accepted, async_scheduling=True) == \
        generate(qwen3_tiny_dir, prompts, params)
    assert generate(qwen3_tiny_dir, prompts, greedy(30), NGRAM, accepted, async_scheduling=True) == plain


@needs_interpreter
def test_triton_backend_same_tokens_with_drafts(tmp_path):
    """The verify step through the Triton kernels (varlen prefill over the paged prefix)."""
    from minivllm.tools.make_model import make_model

    tiny = make_model({"preset": "qwen3-tiny", "num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256,
                       "num_attention_heads": 4, "num_key_value_heads": 2}, tmp_path / "m")
    prompts = copy_heavy_prompts(3, seed=10)
    assert_same_with_drafts(str(tiny), prompts, greedy(12), attention_backend="triton", max_model_len=128)


def draft_spec(model_dir, k: int = 4) -> dict:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k}


def draft_blocks_all_free(llm):
    proposer = llm.scheduler.proposer
    assert not proposer.seqs and proposer.pool.num_free_blocks == proposer.pool.num_blocks


def test_draft_model_equal_to_the_target_has_every_draft_accepted(qwen3_tiny_dir):
    """A draft that is the target itself proposes the target's own greedy tokens: acceptance 1.0,
    and the outputs are those of plain decoding (random prompts: no n-gram would match them)."""
    rng = random.Random(20)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(5, 40))] for _ in range(5)]

    def all_accepted(llm):
        stats = spec_stats(llm)
        assert stats.num_drafts > 20 and stats.num_accepted_tokens == stats.num_draft_tokens, stats
        # acceptance length k + 1 (vLLM's check): every step's k drafts accepted, plus the bonus token;
        # a draft shortened near a request's max_tokens lowers the mean below k, and only there
        k = llm.config.speculative_config["num_speculative_tokens"]
        full = [n for n in stats.num_accepted_tokens_per_pos]
        assert full == sorted(full, reverse=True) and full[0] == stats.num_drafts, stats
        all_accepted.lengths.append(1 + stats.num_accepted_tokens / stats.num_drafts)
        assert all_accepted.lengths[-1] > k + 1 - 0.2, (all_accepted.lengths, k)
        draft_blocks_all_free(llm)
    all_accepted.lengths = []
    plain = generate(qwen3_tiny_dir, prompts, greedy(30))
    assert generate(qwen3_tiny_dir, prompts, greedy(30), draft_spec(qwen3_tiny_dir), all_accepted) == plain
    assert generate(qwen3_tiny_dir, prompts, greedy(30), draft_spec(qwen3_tiny_dir, k=2), all_accepted,
                    async_scheduling=True) == plain


def test_draft_model_of_another_architecture_keeps_the_targets_tokens(qwen3_tiny_dir, llama_tiny_dir):
    """A different draft (Llama, same vocabulary) is often wrong: the outputs are still the target's,
    under preemption and chunked prefill too, and the draft's blocks all come back."""
    prompts = copy_heavy_prompts(6, seed=21)

    def drafted(llm):
        stats = spec_stats(llm)
        assert stats.num_drafts > 0 and stats.num_accepted_tokens < stats.num_draft_tokens, stats
        draft_blocks_all_free(llm)
    plain = generate(qwen3_tiny_dir, prompts, greedy(40))
    assert generate(qwen3_tiny_dir, prompts, greedy(40), draft_spec(llama_tiny_dir), drafted) == plain
    args = dict(num_kvcache_blocks=30, max_model_len=128, max_num_batched_tokens=24)

    def preempted(llm):
        drafted(llm)
        assert llm.scheduler.num_preemptions > 0
    plain = generate(qwen3_tiny_dir, prompts, greedy(40), **args)
    assert generate(qwen3_tiny_dir, prompts, greedy(40), draft_spec(llama_tiny_dir), preempted, **args) == plain


def test_a_draft_with_another_vocabulary_or_tokenizer_is_refused(qwen3_tiny_dir, tmp_path):
    import shutil

    from minivllm.tools.make_model import make_model

    other_vocab = make_model({"preset": "qwen3-tiny", "vocab_size": 9000}, tmp_path / "vocab", seed=1)
    with pytest.raises(ValueError, match=r"vocabulary \(9000 ids\) differs"):
        LLM(qwen3_tiny_dir, **ENGINE_ARGS, speculative_config=draft_spec(other_vocab))
    other_tokenizer = tmp_path / "tokenizer"
    shutil.copytree(qwen3_tiny_dir, other_tokenizer)
    data = json.loads((other_tokenizer / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = list(vocab)[5:7]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: another tokenizer of the same size
    (other_tokenizer / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="tokenizer .* differs"):
        LLM(qwen3_tiny_dir, **ENGINE_ARGS, speculative_config=draft_spec(other_tokenizer))


def test_draft_model_keeps_stops_eos_max_tokens_n_2_and_prefix_hits(qwen3_tiny_dir, llama_tiny_dir):
    """The n-gram scenarios with a draft model, a right one (the target itself) and an often wrong one
    (Llama): stop tokens, stop strings, EOS and max_tokens inside a draft, n = 2, prefix hits; the
    target's tokens and finish reasons each time, and the draft's blocks all come back."""
    prompts = copy_heavy_prompts(5, seed=22)
    reference = generate(qwen3_tiny_dir, prompts, greedy(40))
    stops = [greedy(40, stop_token_ids=[r[0][0][6]]) for r in reference] + [greedy(n) for n in (1, 2, 3, 5, 9)]
    stop_strings = [greedy(40, stop=[text[:len(text) // 4]]) for (_, _, text), in reference]
    eos = reference[0][0][0][10]
    shared = copy_heavy_prompts(2, seed=23)[0]
    with_prefix = [shared + p for p in prompts]

    def hits(llm):
        draft_blocks_all_free(llm)
        assert llm.scheduler.kv_cache_manager.num_cached_tokens_hit > 0
    cases = [(prompts + prompts, stops, {}, draft_blocks_all_free), (prompts, stop_strings, {}, draft_blocks_all_free),
             (prompts, greedy(30, n=2), {}, draft_blocks_all_free),
             (prompts, SamplingParams(temperature=0.0, max_tokens=40), dict(eos_token_id=eos), draft_blocks_all_free),
             (with_prefix, greedy(30), {}, hits)]
    for batch, params, args, check in cases:
        plain = generate(qwen3_tiny_dir, batch, params, **args)
        for draft in (qwen3_tiny_dir, llama_tiny_dir):
            assert generate(qwen3_tiny_dir, batch, params, draft_spec(draft), check, **args) == plain, (draft, args)


@needs_interpreter
def test_triton_backend_same_tokens_with_a_draft_model_and_preemption(tmp_path):
    """The draft model's steps and the verify step through the Triton kernels, under preemption."""
    from minivllm.tools.make_model import make_model

    tiny = str(make_model({"preset": "qwen3-tiny", "num_hidden_layers": 2, "hidden_size": 128,
                           "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}, tmp_path / "m"))
    prompts = copy_heavy_prompts(3, seed=11)
    args = dict(attention_backend="triton", max_model_len=96, num_kvcache_blocks=9, kvcache_block_size=16)

    def preempted(llm):
        assert llm.scheduler.num_preemptions > 0 and spec_stats(llm).num_accepted_tokens > 0
        draft_blocks_all_free(llm)
    plain = generate(tiny, prompts, greedy(12), **args)
    assert generate(tiny, prompts, greedy(12), draft_spec(tiny, k=3), preempted, **args) == plain


def test_smollm2_copy_tasks_same_text_with_ngram_drafts(smollm2_dir):
    """A real model (SmolLM2-135M-Instruct, float32 on the CPU) on the first copy-heavy chat tasks of
    bench_spec_decode: n-gram drafts keep the greedy text identical, and most drafts are accepted."""
    from benchmarks.bench_spec_decode import COPY_TASKS

    args = dict(device="cpu", dtype="float32", max_model_len=1024, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    texts, stats = {}, None
    for spec in (None, NGRAM):
        with LLM(str(smollm2_dir), **args, speculative_config=spec) as llm:
            prompts = [llm.get_tokenizer().apply_chat_template([{"role": "user", "content": task}], tokenize=False,
                                                               add_generation_prompt=True) for task in COPY_TASKS[:4]]
            texts[spec is not None] = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
            if spec is not None:
                stats = spec_stats(llm)
    assert texts[True] == texts[False]
    assert stats.num_drafts > 10 and stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens, stats
