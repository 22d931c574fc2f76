"""Figures the course quotes from recorded results stay true to them.

Convention: where a chapter or README quotes a figure from a result file, it names the file in backticks
(`benchmarks/results/NAME.json`) in the same paragraph. This suite checks that every such file is
committed, and, for the claims listed in CLAIMS, that the number as written equals the JSON's value
within the rounding it was written with: change the text's number or the JSON and a test fails.
Pure file reads: no engine, no GPU, nothing imported from minivllm.
"""
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DOCS = sorted((REPO / "chapters").glob("*.md")) + [REPO / "README.md", REPO / "benchmarks" / "README.md"]
RESULT_PATH = re.compile(r"benchmarks/results/[\w./-]+?\.json")
# benchmarks/README.md also names its results relative to itself (`results/NAME.json`).
RELATIVE_RESULT_PATH = re.compile(r"(?<![\w/])results/[\w./-]+?\.json")
PLACEHOLDER = re.compile(r"(^|/)[A-Z_]+\.json$")  # `benchmarks/results/NAME.json` names the convention


def doc_text(relative: str) -> str:
    """A document with every run of whitespace made one space, so a phrase may wrap across lines."""
    return " ".join((REPO / relative).read_text().split())


def mentioned_results() -> list[tuple[str, str]]:
    """(document, path from the repository root) for every result file the documents name."""
    found = []
    for doc in DOCS:
        text, name = doc.read_text(), str(doc.relative_to(REPO))
        found += [(name, path) for path in RESULT_PATH.findall(text)]
        if doc.parent.name == "benchmarks":
            found += [(name, "benchmarks/" + path) for path in RELATIVE_RESULT_PATH.findall(text)]
    return sorted({(doc, path) for doc, path in found if not PLACEHOLDER.search(path)})


@pytest.mark.parametrize("doc,path", mentioned_results())
def test_named_result_file_is_committed(doc, path):
    assert (REPO / path).is_file(), f"{doc} names {path}, which is not in benchmarks/results/"


def test_the_documents_name_result_files():
    assert len(mentioned_results()) >= 10  # the scan itself works (a broken regex would pass vacuously)


# ---- the claims -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Claim:
    """`number` (as written, inside `phrase`) is `scale` x the value at `path` in `result`.

    path: keys joined by '.' (a key with a '.' in it goes in double quotes; a number indexes a list);
    `name[k=v,...]` picks the elements of list `name` whose fields match (compared as text); if several
    match, `agg` ("min", "max" or "sum") reduces them. `minus`: a path whose value is subtracted first.
    `per`: a path (in `per_result`, by default `result`, with the same `agg`); the value is then
    (path - minus) / per. tol: the allowed difference; by default half a unit of the last digit written
    ("0.137" -> 0.0005, "24,662" -> 0.5).
    """

    doc: str
    phrase: str
    number: str
    result: str
    path: str
    scale: float = 1.0
    per: str | None = None
    agg: str | None = None
    tol: float | None = None
    minus: str | None = None
    per_result: str | None = None

    @property
    def tolerance(self) -> float:
        if self.tol is not None:
            return self.tol
        decimals = len(self.number.split(".")[1]) if "." in self.number else 0
        return 0.5 * 10 ** -decimals + 1e-12


SEGMENT = re.compile(r'(?:"([^"]*)"|([^.\[\]"]+))(?:\[([^\]]*)\])?')
AGGREGATES = {"min": min, "max": max, "sum": sum}


def lookup(node, path: str, agg: str | None):
    for segment in SEGMENT.finditer(path):
        quoted, plain, selector = segment.groups()
        name = plain if quoted is None else quoted
        node = node[int(name)] if isinstance(node, list) else node[name]
        if not selector:
            continue
        fields = dict(part.split("=", 1) for part in selector.split(","))
        matches = [item for item in node if all(str(item.get(k)) == v for k, v in fields.items())]
        assert matches, f"{path}: no element of {name} matches [{selector}]"
        rest = path[segment.end():].lstrip(".")
        values = [lookup(item, rest, None) if rest else item for item in matches]
        if len(values) == 1:
            return values[0]
        assert agg in AGGREGATES, f"{path}: {len(values)} elements match; give agg"
        return AGGREGATES[agg](values)
    return node


THROUGHPUT = "benchmarks/results/bench_throughput.json"
PREFILL = "benchmarks/results/bench_prefill.json"
FP8_KV = "benchmarks/results/bench_throughput_fp8_kv.json"
SPEC_H100 = "benchmarks/results/bench_spec_decode_h100_2026-12-06.json"
CH15 = "chapters/15_speculative_decoding.md"
CH17 = "chapters/17_small_batch_decode.md"
LATENCY_H100 = "benchmarks/results/bench_latency_%s_h100_2026-12-06.json"
GEMV_H100 = "benchmarks/results/bench_gemv_h100_2026-12-06.json"
SMOLLM2_CPU = "benchmarks/results/bench_spec_decode_smollm2_float32_cpu_2026-12-07.json"
LADDER_H100 = "benchmarks/results/bench_ladder_h100_2026-12-07.json"
TUNE_SPLITS_H100 = "benchmarks/results/tune_decode_small_batch_h100_2026-12-07.json"
LATENCY_H100_B = "benchmarks/results/bench_latency_%s_h100_2026-12-07b.json"
LATENCY_H100_C = "benchmarks/results/bench_latency_%s_h100_2026-12-07c.json"
LATENCY_H100_D = "benchmarks/results/bench_latency_%s_h100_2026-12-07d.json"
THROUGHPUT_NEW_H100 = "benchmarks/results/bench_throughput_new_main_h100_2026-12-07.json"
GEMV_PREFETCH_H100 = "benchmarks/results/bench_gemv_b1_prefetch_h100_2026-12-07.json"
SERVING_H100 = "benchmarks/results/bench_serving_%s_main_h100_2026-12-07.json"
MOE_H100 = "benchmarks/results/bench_moe_h100_2026-12-07.json"
MOE_E2E_H100 = "benchmarks/results/bench_throughput_moe_qwen3-30b-a3b_h100_2026-12-07.json"
SPEC_PROFILE_H100 = "benchmarks/results/bench_spec_decode_profile_smollm2_float32_h100_2026-12-07.json"
CH00 = "chapters/00_the_baseline.md"
SMOLLM2_H100 = "benchmarks/results/bench_spec_decode_smollm2_float32_h100_2026-12-07.json"
PROFILE_B1 = "benchmarks/results/profile_decode_b1%s_h100_2026-12-07.json"
RIDGE = dict(result=THROUGHPUT, path="ceilings.matmul.TFLOPs", per="ceilings.copy.TBps")
PREFIX_HIT_OURS = "results[prefix_hit=True,provider=ours].TFLOPs"
PREFIX_HIT_RATIO = "results[prefix_hit=True,provider=sdpa_flash].ours_speedup"
COMPILE_STATS = "benchmarks/results/compile_stats_decode_triton3.6_2026-12-07.json"
CH06 = "chapters/06_paged_attention.md"
CH07 = "chapters/07_cuda_graphs.md"
CH09 = "chapters/09_where_the_time_goes.md"
CH10 = "chapters/10_serving.md"
CH11 = "chapters/11_chunked_prefill.md"
CH12 = "chapters/12_tensor_parallelism.md"
CH13 = "chapters/13_quantization.md"
PROFILE = "benchmarks/results/profile_throughput.json"
PROFILE_DECODE = "benchmarks/results/profile_decode.json"
DECODE_FP8 = "benchmarks/results/bench_decode_fp8.json"
PROBE = "benchmarks/results/probe_decode_bound.json"
FP8_WEIGHTS_8B = "benchmarks/results/bench_throughput_8b_fp8_weights.json"
PROFILE_8B = "benchmarks/results/profile_throughput_8b_%s.json"
GEMM_8B = "benchmarks/results/bench_fp8_gemm_8b_m128_256.json"
SERVING = "benchmarks/results/bench_serving_%s.json"
LATENCY_GRAPHS = "benchmarks/results/bench_chunked_latency_prompt_graphs.json"
STEP_MESSAGE = "benchmarks/results/bench_step_message.json"
DECODE_STEPS_8B = "steps.decode batch  65-128"  # the profile's decode steps of 65-128 sequences (two spaces)

def in_chapters(chapters, phrase, numbers):
    """(chapter, phrase, number, path) for one phrase that several chapters write alike."""
    return [(chapter, phrase, number, path) for chapter in chapters for number, path in numbers]


CLAIMS = [
    # The end-to-end floor: the `floor` fields of the recorded run, on that run's ceilings.
    *[Claim(doc, phrase, number, THROUGHPUT, path, scale) for doc in ("chapters/08_measuring.md",
                                                                      "benchmarks/README.md")
      for phrase, number, path, scale in [
          ("~121 M", "121", "floor.decode_context_token_steps", 1e-6),
          ("~13.9 TB", "13.9", "floor.decode_kv_bytes", 1e-12),
          ("~0.137 PFLOP", "0.137", "floor.prefill_flops", 1e-15),
          ("~0.29 s", "0.29", "floor.weight_seconds", 1),
          ("35.6k output tok/s", "35.6", "floor.output_tok_per_s_at_floor", 1e-3),
          ("133,966 output tokens", "133,966", "workload.output_tokens", 1),
      ]],
    Claim("chapters/08_measuring.md", "~0.19 s at 715 TFLOP/s", "0.19", THROUGHPUT, "floor.prefill_seconds"),
    Claim("chapters/08_measuring.md", "~0.19 s at 715 TFLOP/s", "715", THROUGHPUT, "floor.matmul_TFLOPs"),
    Claim("chapters/08_measuring.md", "~3.3 s at 4.22 TB/s", "3.3", THROUGHPUT, "floor.kv_seconds"),
    Claim("chapters/08_measuring.md", "~3.3 s at 4.22 TB/s", "4.22", THROUGHPUT, "floor.copy_TBps"),
    Claim("chapters/08_measuring.md", "floor 3.76 s", "3.76", THROUGHPUT, "floor.seconds"),
    Claim("benchmarks/README.md", "prefill ~0.137 PFLOP, 0.19 s", "0.19", THROUGHPUT, "floor.prefill_seconds"),
    Claim("benchmarks/README.md", "3.76 s in all", "3.76", THROUGHPUT, "floor.seconds"),
    Claim("benchmarks/README.md", "4.22 TB/s and 715 TFLOP/s", "4.22", THROUGHPUT, "ceilings.copy.TBps"),
    Claim("benchmarks/README.md", "4.22 TB/s and 715 TFLOP/s", "715", THROUGHPUT, "ceilings.matmul.TFLOPs"),
    # The L2 cache, as the runs' environment records it.
    *[Claim(doc, "60 MiB", "60", THROUGHPUT, "environment.l2_cache_bytes", 2 ** -20)
      for doc in ("chapters/08_measuring.md", "benchmarks/README.md")],
    *[Claim(doc, "`l2_cache_bytes` 62914560", "62914560", THROUGHPUT, "environment.l2_cache_bytes")
      for doc in ("chapters/08_measuring.md", "benchmarks/README.md")],
    # The ceilings and the one ridge point (matmul rate / copy bandwidth) of chapters 06 and 08.
    Claim("chapters/08_measuring.md", "matmul rate (715 TFLOP/s)", "715", THROUGHPUT, "ceilings.matmul.TFLOPs"),
    Claim("chapters/08_measuring.md", "slope = bandwidth (4.22 TB/s)", "4.22", THROUGHPUT, "ceilings.copy.TBps"),
    Claim("chapters/08_measuring.md", "715e12 / 4.22e12 ~ 169 FLOP/byte", "169", **RIDGE),
    Claim("chapters/08_measuring.md", "ridge, ~169 FLOP/byte", "169", **RIDGE),
    Claim("chapters/08_measuring.md", "memory below B ~ 169", "169", **RIDGE),
    Claim("chapters/08_measuring.md", "2 FLOP/byte, about 85x below the ridge", "85", scale=0.5, **RIDGE),
    Claim("chapters/08_measuring.md", "recorded 798 TFLOP/s", "798", PREFILL, "ceilings.matmul.TFLOPs"),
    Claim("chapters/06_paged_attention.md", "did 715 TFLOP/s", "715", THROUGHPUT, "ceilings.matmul.TFLOPs"),
    Claim("chapters/06_paged_attention.md", "copied 4.22 TB/s", "4.22", THROUGHPUT, "ceilings.copy.TBps"),
    Claim("chapters/06_paged_attention.md", "715 / 4.22 ~ 169 FLOP/byte", "169", **RIDGE),
    Claim("chapters/06_paged_attention.md", "at 2, sits ~85× below it", "85", scale=0.5, **RIDGE),
    # End to end with bfloat16 logits, and after the LM head went back to float32 logits (chapter 09's
    # account of it now in benchmarks/README.md, "Run histories moved from the chapters").
    *[Claim(doc, "24,662 with bfloat16 logits", "24,662", THROUGHPUT, "minivllm.output_tok_per_s")
      for doc in ("benchmarks/README.md", "chapters/14_sampling_and_outputs.md")],
    *[Claim(doc, "has 24,900 for its bfloat16 cache", "24,900", FP8_KV, "minivllm_unquantized.output_tok_per_s",
            tol=1) for doc in ("benchmarks/README.md", "chapters/14_sampling_and_outputs.md")],
    *[Claim(doc, "the 4.22 TB/s copy rate", "4.22", THROUGHPUT, "ceilings.copy.TBps")
      for doc in ("benchmarks/README.md", "chapters/14_sampling_and_outputs.md")],
    # Prefill attention as bench_prefill.json records it (2026-11-29, before the chunk path's change;
    # chapter 11's account of it now in benchmarks/README.md, "Run histories moved from the chapters").
    *[Claim(doc, phrase, number, PREFILL, path, agg=agg)
      for doc, ratios in (("benchmarks/README.md", "0.77-1.44x SDPA flash"),
                          ("README.md", "0.77x-1.44x SDPA flash"))
      for phrase, number, path, agg in [
          ("at 143-318 TFLOP/s", "143", PREFIX_HIT_OURS, "min"),
          ("at 143-318 TFLOP/s", "318", PREFIX_HIT_OURS, "max"),
          (ratios, "0.77", PREFIX_HIT_RATIO, "min"),
          (ratios, "1.44", PREFIX_HIT_RATIO, "max"),
      ]],
    Claim("benchmarks/README.md", "against 210-482 TFLOP/s", "210", PREFILL,
          "results[case=16x512,provider=ours].TFLOPs"),
    Claim("benchmarks/README.md", "against 210-482 TFLOP/s", "482", PREFILL,
          "results[case=1x16384,provider=ours].TFLOPs"),
    Claim("benchmarks/README.md", "and 1.26-1.92x at the same five shapes", "1.26", PREFILL,
          "results[case=16x512,provider=sdpa_flash].ours_speedup"),
    Claim("benchmarks/README.md", "and 1.26-1.92x at the same five shapes", "1.92", PREFILL,
          "results[case=1x4096,provider=sdpa_flash].ours_speedup"),
    Claim("benchmarks/README.md", "at the 482 TFLOP/s of 2026-11-29", "482", PREFILL,
          "results[case=1x16384,provider=ours].TFLOPs"),
    # Draft models on the H100 (chapter 15, section 6)
    Claim(CH15, "agreed on 201 of 212 drafts", "201", SPEC_H100, "spec.draft=target k=4.1.num_accepted_tokens"),
    Claim(CH15, "agreed on 201 of 212 drafts", "212", SPEC_H100, "spec.draft=target k=4.1.num_draft_tokens"),
    Claim(CH15, "ran at 0.89x no speculation", "0.89", SPEC_H100, "spec.draft=target k=4.1.output_tok_s",
          per="spec.none.1.output_tok_s"),
    Claim(CH15, "and ran at 0.50x", "0.50", SPEC_H100, "spec.draft 2-layer k=4.1.output_tok_s",
          per="spec.none.1.output_tok_s"),
    # SmolLM2 in float32 on a CPU: n-gram drafts change no text (benchmarks/README.md, speculative decoding).
    *[Claim("benchmarks/README.md", phrase, number, SMOLLM2_CPU, path) for phrase, number, path in [
        ("for 24 of 24 prompts", "24", "smollm2.ngram k=4.prompts_with_same_text"),
        ("848 of 1,218 draft tokens accepted", "848", "smollm2.ngram k=4.num_accepted_tokens"),
        ("848 of 1,218 draft tokens accepted", "1,218", "smollm2.ngram k=4.num_draft_tokens"),
        ("(acceptance length 3.78)", "3.78", "smollm2.ngram k=4.acceptance_length"),
        ("The CPU's 1.51x", "1.51", "smollm2.ngram k=4.speedup"),
    ]],
    # The batch-1 decode step on the H100 (chapter 17): the three engines, the floor, the step's linears.
    *[Claim(CH17, phrase, number, result, path, scale) for phrase, number, result, path, scale in [
        ("took 1.461 ms a step at batch 1", "1.461", LATENCY_H100 % "default", "decode_step_ms.1", 1),
        ("= 0.435 ms", "0.435", LATENCY_H100 % "default", "floor.decode_ms.1", 1),
        ("/ 3.02 TB/s", "3.02", LATENCY_H100 % "default", "copy.TBps", 1),
        ("1,192,099,840 bytes of weights", "1,192,099,840", LATENCY_H100 % "default", "floor.weight_bytes", 1),
        ("114,688 bytes of KV per context token", "114,688", LATENCY_H100 % "default", "floor.kv_bytes_per_token", 1),
        ("(1.551 ms on the same H100)", "1.551", LATENCY_H100 % "default", "decode_step_ms.4", 1),
        ("1.899 ms a step at batch 1", "1.899", LATENCY_H100 % "gemv", "decode_step_ms.1", 1),
        ("the defaults' 1.461", "1.461", LATENCY_H100 % "default", "decode_step_ms.1", 1),
        ("1.998 ms at batch 1", "1.998", LATENCY_H100 % "gemv_pdl", "decode_step_ms.1", 1),
        ("against 1.899 without it", "1.899", LATENCY_H100 % "gemv", "decode_step_ms.1", 1),
        ("2.424 against 2.059 at batch 4", "2.424", LATENCY_H100 % "gemv_pdl", "decode_step_ms.4", 1),
        ("2.424 against 2.059 at batch 4", "2.059", LATENCY_H100 % "gemv", "decode_step_ms.4", 1),
        ("first token in 6.69 ms", "6.69", LATENCY_H100 % "gemv_pdl", "ttft_ms.128", 1),
        ("against 3.75", "3.75", LATENCY_H100 % "gemv", "ttft_ms.128", 1),
    ]],
    Claim(CH17, "3.36 times the floor", "3.36", LATENCY_H100 % "default", "decode_step_ms.1",
          per="floor.decode_ms.1"),
    *[Claim(CH17, f"| {row} | {floor} | {unfused} | {cublas} |", number, GEMV_H100,
            f"results[case={layer} M=1,provider={provider}].{field}", 1e3)
      for row, layer, floor, unfused, cublas in [("QKV", "qkv", "2.8", "12.7", "10.1"),
                                                 ("o_proj", "o", "1.4", "9.7", "9.8"),
                                                 ("gate/up", "gate_up", "4.2", "14.3", "11.8"),
                                                 ("down", "down", "2.1", "13.5", "11.7")]
      for number, provider, field in [(floor, "cublas", "floor_ms"), (unfused, "unfused", "ms"),
                                      (cublas, "cublas", "ms")]],
    # SmolLM2 in float32 on an H100 (benchmarks/README.md, 2026-12-07).
    *[Claim("benchmarks/README.md", phrase, number, SMOLLM2_H100, path) for phrase, number, path in [
        ("without speculation 787 output tok/s", "787", "smollm2.none.output_tok_s"),
        ("with n-gram drafts 989 (1.26x)", "989", "smollm2.ngram k=4.output_tok_s"),
        ("with n-gram drafts 989 (1.26x)", "1.26", "smollm2.ngram k=4.speedup"),
        ("acceptance length 3.76 (848 of 1,226", "3.76", "smollm2.ngram k=4.acceptance_length"),
        ("acceptance length 3.76 (848 of 1,226", "1,226", "smollm2.ngram k=4.num_draft_tokens"),
        ("in 307 drafts", "307", "smollm2.ngram k=4.num_drafts"),
        ("identical for 24 of 24 prompts", "24", "smollm2.ngram k=4.prompts_with_same_text"),
    ]],
    # The whole ladder on an H100, 2026-12-07 (chapter 00 and benchmarks/README.md).
    *[Claim(CH00, phrase, number, LADDER_H100, path) for phrase, number, path in [
        ("16 requests, 5,641 prompt and 4,601 output tokens", "5,641", "workload.prompt_tokens"),
        ("16 requests, 5,641 prompt and 4,601 output tokens", "4,601", "workload.output_tokens"),
        ("Rung 0 makes 299 output tok/s", "299", "rungs[rung=0].output_tok_per_s"),
        ("(0.201x and 0.213x)", "0.201", "rungs[rung=1].ratio_to_baseline"),
        ("(0.201x and 0.213x)", "0.213", "rungs[rung=2].ratio_to_baseline"),
        ("take the whole batch per launch (1.76x)", "1.76", "rungs[rung=3].ratio_to_baseline"),
        ("that are left (12.5x)", "12.5", "rungs[rung=4].ratio_to_baseline"),
        ("brings it to 6,931 tok/s, 23.2x", "6,931", "rungs[rung=7].output_tok_per_s"),
        ("brings it to 6,931 tok/s, 23.2x", "23.2", "rungs[rung=7].ratio_to_baseline"),
    ]],
    *[Claim("benchmarks/README.md", f"| {rung} | {adds} | {seconds} | {tok_s} | {ratio} |", number, LADDER_H100,
            f"rungs[rung={rung}].{path}")
      for rung, adds, seconds, tok_s, ratio in [
          (0, "chapter 00's loop", "15.37", "299", "1x"),
          (1, "the core: paged KV, continuous batching, torch attention, eager", "76.47", "60.2", "0.201x"),
          (2, "+ prefix caching (1,920 prompt tokens hit)", "72.27", "63.7", "0.213x"),
          (3, "+ Triton attention kernels", "8.73", "527", "1.76x"),
          (4, "+ CUDA graphs", "1.23", "3,751", "12.5x"),
          (5, "+ async scheduling", "1.09", "4,205", "14x"),
          (6, "+ chunked prefill", "1.09", "4,207", "14.1x"),
          (7, "+ fused small ops (`LLM(...)`'s defaults)", "0.66", "6,931", "23.2x")]
      for number, path in [(seconds, "seconds"), (tok_s, "output_tok_per_s")]],
    Claim("benchmarks/README.md", "+ prefix caching (1,920 prompt tokens hit)", "1,920", LADDER_H100,
          "rungs[rung=2].prefix_cache_hit_tokens"),
    Claim("README.md", "made 23.2x the output tok/s", "23.2", LADDER_H100, "rungs[rung=7].ratio_to_baseline"),
    # Each chapter's rung of the H100 ladder.
    *[Claim(f"chapters/{chapter}.md", phrase, number, LADDER_H100, path) for chapter, phrase, number, path in [
        *in_chapters(("02_paged_kv_cache", "03_scheduler"), "rung 1 made 60.2 output tok/s, 0.201x the naive loop",
                     [("60.2", "rungs[rung=1].output_tok_per_s"), ("0.201", "rungs[rung=1].ratio_to_baseline")]),
        ("04_prefix_caching", "gave 1,920 prompt tokens from the cache", "1,920", "rungs[rung=2].prefix_cache_hit_tokens"),
        ("04_prefix_caching", "rung 2 made 1.06x rung 1", "1.06", "rungs[rung=2].ratio_to_previous"),
        *in_chapters(("05_flash_attention", "06_paged_attention"), "rung 3 made 527 output tok/s, 8.28x rung 2",
                     [("527", "rungs[rung=3].output_tok_per_s"), ("8.28", "rungs[rung=3].ratio_to_previous")]),
        *in_chapters(("07_cuda_graphs",), "on an H100 7.12x and 1.12x the rung before",
                     [("7.12", "rungs[rung=4].ratio_to_previous"), ("1.12", "rungs[rung=5].ratio_to_previous")]),
        *in_chapters(("09_where_the_time_goes",), "on an H100 1.65x rung 6 and 23.2x rung 0",
                     [("1.65", "rungs[rung=7].ratio_to_previous"), ("23.2", "rungs[rung=7].ratio_to_baseline")]),
        ("11_chunked_prefill", "on an H100 1.00x rung 5", "1.00", "rungs[rung=6].ratio_to_previous"),
    ]],
    # The decode splits at batch 1 on the H100 (benchmarks/README.md): the kernel sweep and the engine.
    *[Claim("benchmarks/README.md", "(0.0124 against 0.0171 ms)", number, TUNE_SPLITS_H100,
            f'rows[kind=decode,shape=1x1024/b16,provider={provider}].ms')
      for number, provider in [("0.0124", "triton n64 w4 s2 p8 m64 splits16"),
                               ("0.0171", "triton n64 w4 s2 p8 m256 splits4")]],
    *[Claim("benchmarks/README.md", phrase, number, LATENCY_H100_B % label, path) for phrase, number, label, path in [
        ("| the defaults (then: `min_split_tokens` 256) | 1.461 | 1.564 | 3.76 |", "1.461", "default", 'decode_step_ms."1"'),
        ("| the defaults (then: `min_split_tokens` 256) | 1.461 | 1.564 | 3.76 |", "1.564", "default", 'decode_step_ms."4"'),
        ("| the defaults (then: `min_split_tokens` 256) | 1.461 | 1.564 | 3.76 |", "3.76", "default", 'ttft_ms."128"'),
        ("| `small_batch_gemv=True` | 1.256 | 2.044 | 3.63 |", "1.256", "gemv", 'decode_step_ms."1"'),
        ("| `small_batch_gemv=True` | 1.256 | 2.044 | 3.63 |", "2.044", "gemv", 'decode_step_ms."4"'),
        ("| `small_batch_gemv=True` | 1.256 | 2.044 | 3.63 |", "3.63", "gemv", 'ttft_ms."128"'),
        ("`min_split_tokens` 64 | 1.159 | 2.034 | 3.81 |", "1.159", "gemv_split64", 'decode_step_ms."1"'),
        ("`min_split_tokens` 64 | 1.159 | 2.034 | 3.81 |", "2.034", "gemv_split64", 'decode_step_ms."4"'),
        ("`min_split_tokens` 64 | 1.159 | 2.034 | 3.81 |", "3.81", "gemv_split64", 'ttft_ms."128"'),
        ("2.67 times the 0.435 ms floor", "0.435", "gemv_split64", 'floor.decode_ms."1"'),
    ]],
    Claim(CH17, "step fell from 1.256 to 1.159 ms", "1.159", LATENCY_H100_B % "gemv_split64", 'decode_step_ms."1"'),
    # The night run of 2026-12-07 (an H100): the GEMVs at batch 1-64, new main at 256 requests, GEMV prefetch
    Claim(CH17, "and batch 1 1.13x faster", "1.13", LATENCY_H100_D % "default", 'decode_step_ms."1"',
          per='decode_step_ms."1"', per_result=LATENCY_H100_D % "gemv"),
    *[Claim("benchmarks/README.md", f"| decode step, batch {batch} | {default} | {gemv} | {floor} |", number,
            LATENCY_H100_D % label, path)
      for batch, default, gemv, floor in [(1, "1.449", "1.284", "0.437"), (4, "1.578", "1.576", "0.561"),
                                          (16, "2.122", "2.112", "1.057"), (64, "4.287", "4.284", "3.042")]
      for number, label, path in [(default, "default", f'decode_step_ms."{batch}"'),
                                  (gemv, "gemv", f'decode_step_ms."{batch}"'),
                                  (floor, "default", f'floor.decode_ms."{batch}"')]],
    Claim("benchmarks/README.md", "| 20,046 (6.683 s) | 19,867 (6.743 s) |", "19,867", THROUGHPUT_NEW_H100,
          "minivllm.output_tok_per_s"),
    Claim("benchmarks/README.md", "| 20,046 (6.683 s) | 19,867 (6.743 s) |", "6.743", THROUGHPUT_NEW_H100,
          "minivllm.seconds"),
    Claim("benchmarks/README.md", "New main reaches 77% of the floor", "77", THROUGHPUT_NEW_H100, "floor.seconds", 100,
          per="minivllm.seconds"),
    *[Claim("benchmarks/README.md", "| `gemv_config`'s tiles | 6.65 | 4.67 | 8.40 | 6.99 | 26.7 | 111.0 |", number,
            GEMV_PREFETCH_H100, path, 1e3)
      for number, path in [("6.65", "results[case=qkv M=1,provider=ours].ms"), ("26.7", "layer[provider=ours].ms")]],
    *[Claim("benchmarks/README.md", "| the same with `PREFETCH` | 7.40 | 4.92 | 8.88 | 6.93 | 28.1 | 117.0 |", number,
            GEMV_PREFETCH_H100, path, 1e3)
      for number, path in [("7.40", "results[case=qkv M=1,provider=prefetch].ms"),
                           ("28.1", "layer[provider=prefetch].ms")]],
    # Batch 1, 2 and 4 with min_split_tokens 64, the defaults and the GEMVs (an H100, 2026-12-07, evening)
    *[Claim(path_of, phrase, number, LATENCY_H100_C % label, f'decode_step_ms."{batch}"')
      for path_of, phrase, number, label, batch in [
          ("benchmarks/README.md", "| 1.347 (3.09x the 0.435 floor) | 1.414 | 1.532 |", "1.347", "default", 1),
          ("benchmarks/README.md", "| 1.347 (3.09x the 0.435 floor) | 1.414 | 1.532 |", "1.414", "default", 2),
          ("benchmarks/README.md", "| 1.347 (3.09x the 0.435 floor) | 1.414 | 1.532 |", "1.532", "default", 4),
          ("benchmarks/README.md", "| 1.157 (2.66x) | 1.453 | 2.028 |", "1.157", "gemv", 1),
          ("benchmarks/README.md", "| 1.157 (2.66x) | 1.453 | 2.028 |", "1.453", "gemv", 2),
          ("benchmarks/README.md", "| 1.157 (2.66x) | 1.453 | 2.028 |", "2.028", "gemv", 4),
          (CH17, "1.453 ms with the GEMVs against 1.414 without", "1.453", "gemv", 2),
          (CH17, "1.453 ms with the GEMVs against 1.414 without", "1.414", "default", 2),
      ]],
    # The batch-1 step kernel by kernel on the H100, 2026-12-07 (chapter 17, section 5b).
    *[Claim(CH17, phrase, number, PROFILE_B1 % label, path, scale) for phrase, number, label, path, scale in [
        ("| engine step, CUDA graphs | 1.45 | 1.28 |", "1.45", "", "graph_step_ms", 1),
        ("| engine step, CUDA graphs | 1.45 | 1.28 |", "1.28", "_gemv", "graph_step_ms", 1),
        ("| kernels per step | 319 | 207 |", "319", "", "graph_kernels_per_step", 1),
        ("| kernels per step | 319 | 207 |", "207", "_gemv", "graph_kernels_per_step", 1),
        ("| 0.481 + 0.144 + 0.046 (cuBLAS", "0.481", "", "graph_top.0.1", 1),
        ("| 0.481 + 0.144 + 0.046 (cuBLAS", "0.144", "", "graph_top.2.1", 1),
        ("| 0.481 + 0.144 + 0.046 (cuBLAS", "0.046", "", "graph_top.6.1", 1),
        ("| 0.657 (112 GEMVs) |", "0.657", "_gemv", "graph_top.0.1", 1),
        ("| 0.657 (112 GEMVs) |", "112", "_gemv", "graph_top.0.2", 1),
        ("| LM head | 0.110 | 0.110 |", "0.110", "", "graph_top.3.1", 1),
        ("| paged decode + merge | 0.303 + 0.042 | 0.306 + 0.042 |", "0.303", "", "graph_top.1.1", 1),
        ("| paged decode + merge | 0.303 + 0.042 | 0.306 + 0.042 |", "0.306", "_gemv", "graph_top.1.1", 1),
        ("| paged decode + merge | 0.303 + 0.042 | 0.306 + 0.042 |", "0.042", "", "graph_top.7.1", 1),
        ("| 0.082 + 0.072 + 0.033 |", "0.082", "", "graph_top.4.1", 1),
        ("| 0.082 + 0.072 + 0.033 |", "0.072", "", "graph_top.5.1", 1),
        ("| 0.082 + 0.072 + 0.033 |", "0.033", "", "graph_top.8.1", 1),
        ("| 0.076 (norms and SiLU in the GEMVs) |", "0.076", "_gemv", "graph_top.3.1", 1),
        ("10.8 µs a layer", "10.8", "", "graph_top.1.1", 1e3 / 28),
    ]],
    # Chapter 06: the decode attention kernels over the whole workload, with both scheduling changes.
    *[Claim(CH06, "took 3.56 s, reading the K/V bytes the decode steps must read at 3.89 TB/s, 92% of the same "
            "run's 4.22 TB/s copy ceiling", number, PROFILE, path, scale, per)
      for number, path, scale, per in [("3.56", "by_category_s.decode attention", 1, None),
                                       ("3.89", "decode_attention_TBps", 1, None),
                                       ("92", "decode_attention_TBps", 100, "copy_TBps"),
                                       ("4.22", "copy_TBps", 1, None)]],
    # Chapter 07: a decode step at batch 256, context 1024, with async scheduling.
    Claim(CH07, "async scheduling took 8.34 ms", "8.34", PROFILE_DECODE, "graph_step_ms"),
    Claim(CH07, "the graph replay alone (8.39 ms)", "8.39", PROFILE_DECODE, "graph_replay_ms"),
    Claim(CH07, "That is 0.98x the attention + GEMM", "0.98", PROFILE_DECODE, "step_over_attention_plus_gemm"),
    Claim(CH07, "in an eager step (8.51 ms)", "8.51", PROFILE_DECODE, "attention_plus_gemm_ms"),
    # Chapter 09: the profiled run, and bench_throughput's in the same hour.
    Claim(CH09, "5.35 s timed, 25,046 output tok/s", "5.35", PROFILE, "wall_s"),
    Claim(CH09, "5.35 s timed, 25,046 output tok/s", "25,046", PROFILE, "output_tok_per_s"),
    Claim(CH09, "from 18,772 to 25,046 output tok/s", "25,046", PROFILE, "output_tok_per_s"),
    Claim(CH09, "to 5.35 s timed, 53% to 70% of the floor", "5.35", PROFILE, "wall_s"),
    Claim(CH09, "to 5.35 s timed, 53% to 70% of the floor", "70", PROFILE, "floor.seconds", 100, per="wall_s"),
    *[Claim(CH09, phrase, number, PROFILE, f"steps.{bucket}.seconds", 1e3, per=f"steps.{bucket}.steps")
      for phrase, number, bucket in [("a decode step took 1.82 ms at batch 1-16", "1.82", "decode batch   1-16"),
                                     ("growing to 6.17 ms at 193-256", "6.17", "decode batch 193-256"),
                                     ("the 9 prefill steps took 33.1 ms each", "33.1", "prefill")]],
    Claim(CH09, "the 9 prefill steps took 33.1 ms each", "9", PROFILE, "steps.prefill.steps"),
    *[Claim(CH09, "5.43 s, 24,662 output tok/s, 69% of the floor, 37.6x transformers `generate` (655 tok/s at "
            "batch 256)", number, THROUGHPUT, path, scale)
      for number, path, scale in [("5.43", "minivllm.seconds", 1), ("24,662", "minivllm.output_tok_per_s", 1),
                                  ("69", "minivllm.fraction_of_floor", 100),
                                  ("37.6", "ratio_minivllm_over_hf_output_tok_per_s", 1),
                                  ("655", "hf.output_tok_per_s", 1)]],
    Claim(CH09, "The floor is 3.76 s", "3.76", THROUGHPUT, "floor.seconds"),
    Claim(CH09, "75% of it (5.02 s, about 26.7k tok/s)", "5.02", THROUGHPUT, "floor.seconds", 1 / 0.75),
    Claim(CH09, "75% of it (5.02 s, about 26.7k tok/s)", "26.7", THROUGHPUT, "workload.output_tokens", 0.75e-3,
          per="floor.seconds"),
    Claim(CH09, "133,966 output tokens, floor 3.76 s (about 35.6k", "3.76", THROUGHPUT, "floor.seconds"),
    Claim(CH09, "133,966 output tokens, floor 3.76 s (about 35.6k", "35.6", THROUGHPUT,
          "floor.output_tok_per_s_at_floor", 1e-3),
    # Chapter 10: serving on the H200, whole prompts against chunked prefill.
    *[Claim(CH10, phrase, number, SERVING % setting, f"results[request_rate={rate}].{path}")
      for rate, phrase, values in [
          ("8.0", "| 8 req/s | **18.8** / 39.3 | **1.75** / 1.88 | 6.53 / 13.5 | 977 / 977 |",
           [("18.8", "39.3"), ("1.75", "1.88"), ("6.53", "13.5"), ("977", "977")]),
          ("32.0", "| 32 req/s | **21.4** / 48.5 | **2.05** / 3.07 | 10.2 / 22.2 | 3,857 / 3,852 |",
           [("21.4", "48.5"), ("2.05", "3.07"), ("10.2", "22.2"), ("3,857", "3,852")]),
          ("inf", "| inf | **682** / 801 | 12.8 / 13.2 | 84.0 / 81.5 | **21,101** / 19,588 |",
           [("682", "801"), ("12.8", "13.2"), ("84.0", "81.5"), ("21,101", "19,588")])]
      for (whole, chunked), path in zip(values, ["ttft_ms.p99", "tpot_ms.mean", "itl_ms.p99", "output_throughput"])
      for number, setting in [(whole, "prompt_graphs"), (chunked, "chunked_on")]],
    # Chapter 11: the latency scenario with prompt-step graphs.
    *[Claim(CH11, phrase, number, LATENCY_GRAPHS, f"results[chunked_prefill={on}].{path}", scale)
      for phrase, number, on, path, scale in [
          ("35.1 / 5.57 ms (**6.3x**; budget 2048)", "35.1", True, "max_gap_s", 1e3),
          ("35.1 / 5.57 ms (**6.3x**; budget 2048)", "5.57", True, "median_gap_s", 1e3),
          ("35.1 / 5.57 ms (**6.3x**; budget 2048)", "6.3", True, "max_over_median", 1),
          ("103.7 / 5.46 ms (19.0x)", "103.7", False, "max_gap_s", 1e3),
          ("103.7 / 5.46 ms (19.0x)", "5.46", False, "median_gap_s", 1e3),
          ("103.7 / 5.46 ms (19.0x)", "19.0", False, "max_over_median", 1),
          ("| the 16k prompt's time to first token | 258 ms | 100 ms |", "258", True, "ttft_s", 1e3),
          ("| the 16k prompt's time to first token | 258 ms | 100 ms |", "100", False, "ttft_s", 1e3),
          ("(100 ms against 258 ms)", "100", False, "ttft_s", 1e3),
          ("(100 ms against 258 ms)", "258", True, "ttft_s", 1e3),
          ("The 49 gaps it recorded", "49", True, "num_gaps", 1),
      ]],
    *[Claim(CH11, "| 8.0 35.1 | 22.8 23.5 24.1 26.1 26.8 30.3 34.8 | 30.2 | 6.7 5.6 x 19", number, LATENCY_GRAPHS,
            f"results[chunked_prefill=True].gaps_ms.{index}")
      for index, number in enumerate(["8.0", "35.1", "22.8", "23.5", "24.1", "26.1", "26.8", "30.3", "34.8",
                                      "30.2", "6.7"], start=19)],
    Claim(CH11, "the gaps grew by 12.0 ms", "12.0", LATENCY_GRAPHS, "results[chunked_prefill=True].gaps_ms.27",
          minus="results[chunked_prefill=True].gaps_ms.21"),
    Claim(CH11, "chunk's 34.8 ms: the same 6.3x", "6.3", LATENCY_GRAPHS, "results[chunked_prefill=True].gaps_ms.27",
          1e-3, per="results[chunked_prefill=True].median_gap_s"),
    # Chapter 12: one step's message on the host, each method less the all-reduce alone.
    *[Claim(CH12, phrase, number, STEP_MESSAGE, f'results.{case}."{method}".median_us',
            minus=f'results.{case}."none (all-reduce only)".median_us')
      for case, phrase, numbers in [
          ("header only", "| +528 us | +153 us | +35 us | +156 us |", ["528", "153", "35", "156"]),
          ("header + decode inputs of 256 sequences", "| +680 us | +180 us | +335 us | +694 us |",
           ["680", "180", "335", "694"])]
      for number, method in zip(numbers, ["torch.distributed broadcast", "shared memory + spin",
                                          "shared memory + event", "pipe (pickle)"])],
    Claim(CH12, "the header alone (48 B", "48", STEP_MESSAGE, "header_bytes"),
    Claim(CH12, "for 256 sequences (262 KiB)", "262", STEP_MESSAGE,
          "results.header + decode inputs of 256 sequences.payload_bytes", 2 ** -10),
    Claim(CH12, "medians of 2,000 steps", "2,000", STEP_MESSAGE, "options.steps"),
    # Chapter 13: the FP8 decode kernel, its HBM-vs-L2 probe, both end-to-end runs, the 8B GEMMs at M = 128.
    *[Claim(CH13, phrase, number, DECODE_FP8, f"results[case={case},provider={provider}].{field}", scale)
      for case, phrase, bf16_ms, bf16_share, fp8_ms, fp8_share in [
          ("8x32768", "| 8x32768 | 0.261 ms, 98% of copy bandwidth | 0.288 ms, 44% |", "0.261", "98", "0.288", "44"),
          ("64x4096", "| 64x4096 | 0.261 ms, 98% | 0.279 ms, 46% |", "0.261", "98", "0.279", "46"),
          ("256x4096", "| 256x4096 | 0.959 ms, 106% | 1.09 ms, 47% |", "0.959", "106", "1.09", "47")]
      for number, provider, field, scale in [(bf16_ms, "ours_graph", "ms", 1),
                                             (bf16_share, "ours_graph", "fraction_of_copy", 100),
                                             (fp8_ms, "ours_fp8_graph", "ms", 1),
                                             (fp8_share, "ours_fp8_graph", "fraction_of_copy", 100)]],
    *[Claim(CH13, phrase, number, PROBE, f"rows[shape={shape},cache={cache}].{field}")
      for phrase, shape, cache, numbers in [
          ("| bf16 cache | 0.263 ms | 0.178 ms | 0.68 |", "64x4096", "bfloat16", ["0.263", "0.178", "0.68"]),
          ("| FP8 cache | 0.275 ms | 0.249 ms | 0.91 |", "64x4096", "fp8", ["0.275", "0.249", "0.91"]),
          ("the FP8 kernel still takes 0.249 ms", "64x4096", "fp8", [None, "0.249", None]),
          ("L2 / HBM 0.89 and 0.90 for FP8, 0.67 for bf16", "8x32768", "fp8", [None, None, "0.89"]),
          ("L2 / HBM 0.89 and 0.90 for FP8, 0.67 for bf16", "256x4096", "fp8", [None, None, "0.90"]),
          ("L2 / HBM 0.89 and 0.90 for FP8, 0.67 for bf16", "8x32768", "bfloat16", [None, None, "0.67"]),
          ("L2 / HBM 0.89 and 0.90 for FP8, 0.67 for bf16", "256x4096", "bfloat16", [None, None, "0.67"])]
      for number, field in zip(numbers, ["hbm_ms", "l2_ms", "l2_over_hbm"]) if number is not None],
    *[Claim(CH13, phrase, number, FP8_KV, path, scale) for phrase, number, path, scale in [
        ("22,963 output tok/s with the FP8 cache against 24,900 with bf16, 0.92x", "22,963",
         "minivllm.output_tok_per_s", 1),
        ("22,963 output tok/s with the FP8 cache against 24,900 with bf16, 0.92x", "24,900",
         "minivllm_unquantized.output_tok_per_s", 1),
        ("22,963 output tok/s with the FP8 cache against 24,900 with bf16, 0.92x", "0.92",
         "ratio_quantized_over_unquantized_output_tok_per_s", 1),
        ("at 0.92x the bf16 cache's speed", "0.92", "ratio_quantized_over_unquantized_output_tok_per_s", 1),
        ("the FP8 floor is 2.12 s against 3.76 s", "2.12", "floor.seconds", 1),
        ("the FP8 floor is 2.12 s against 3.76 s", "3.76", "floor_unquantized.seconds", 1),
        ("FP8 reaches 36% of its floor and bf16 70% of its own", "36", "minivllm.fraction_of_floor", 100),
        ("FP8 reaches 36% of its floor and bf16 70% of its own", "70", "minivllm_unquantized.fraction_of_floor", 100),
    ]],
    *[Claim(CH13, phrase, number, FP8_WEIGHTS_8B, path, scale)
      for phrase, prefix, floor, numbers in [
          ("| bf16 | 12,980 | 3.65 s (1.17 + 1.83 + 0.65) | 72% |", "minivllm_unquantized", "floor_unquantized",
           ["12,980", None, "3.65", "1.17", "1.83", "0.65", "72"]),
          ("| FP8 | 14,256 (1.10x) | 2.81 s (1.17 + 0.99 + 0.65) | 61% |", "minivllm", "floor",
           ["14,256", "1.10", "2.81", "1.17", "0.99", "0.65", "61"])]
      for number, path, scale in zip(numbers, [f"{prefix}.output_tok_per_s",
                                               "ratio_quantized_over_unquantized_output_tok_per_s",
                                               f"{floor}.seconds", f"{floor}.kv_seconds", f"{floor}.weight_seconds",
                                               f"{floor}.prefill_seconds", f"{prefix}.fraction_of_floor"],
                                     [1, 1, 1, 1, 1, 1, 100]) if number is not None],
    *[Claim(CH13, phrase, number, COMPILE_STATS, f"variants[variant=decode {cache} cache rows 16 stages 2].counts.{op}")
      for phrase, number, cache, op in [("reads bf16 out with 19 plain loads and 28 ldmatrix", "19", "bf16", "LDS"),
                                        ("reads bf16 out with 19 plain loads and 28 ldmatrix", "28", "bf16", "LDSM"),
                                        ("FP8 with 104 plain loads", "104", "fp8 cvt", "LDS")]],
    Claim(CH13, "Qwen3-8B workload 1.10x faster than bf16", "1.10", FP8_WEIGHTS_8B,
          "ratio_quantized_over_unquantized_output_tok_per_s"),
    Claim(CH13, "The floors promise 1.30x", "1.30", FP8_WEIGHTS_8B, "floor_unquantized.seconds", per="floor.seconds"),
    Claim(CH13, "prefill 1.46x faster", "1.46", PROFILE_8B % "bf16", "steps.prefill.seconds",
          per="steps.prefill.seconds", per_result=PROFILE_8B % "fp8_weights"),
    Claim(CH13, "a decode step only 1.08x (8.61 to 8.00 ms)", "1.08", PROFILE_8B % "bf16", DECODE_STEPS_8B + ".seconds",
          per=DECODE_STEPS_8B + ".seconds", per_result=PROFILE_8B % "fp8_weights"),
    *[Claim(CH13, "a decode step only 1.08x (8.61 to 8.00 ms)", number, PROFILE_8B % weights,
            DECODE_STEPS_8B + ".seconds", 1e3, per=DECODE_STEPS_8B + ".steps")
      for number, weights in [("8.61", "bf16"), ("8.00", "fp8_weights")]],
    Claim(CH13, "(144 launches a step, 4.2 us each)", "4.2", PROFILE_8B % "fp8_weights", "top_kernels.2.1", 1e6,
          per="top_kernels.2.2"),
    *[Claim(CH13, phrase, number, GEMM_8B, f"results[M=128,provider={provider}].ms", 1 if per else 1e3, agg="sum",
            per=per and f"results[M=128,provider={per}].ms")
      for phrase, number, provider, per in [
          ("take 150.7 us in bf16 and 117.4 us in FP8", "150.7", "bf16", None),
          ("take 150.7 us in bf16 and 117.4 us in FP8", "117.4", "scaled_mm", None),
          ("1.28x, not 2x", "1.28", "bf16", "scaled_mm"),
          ("brings the layer to 135.7 us, 1.11x", "135.7", "scaled_mm+quant", None),
          ("brings the layer to 135.7 us, 1.11x", "1.11", "bf16", "scaled_mm+quant")]],
    *[Claim(CH13, "streams these weights at 1.0-2.5 TB/s, bf16 at 1.8-3.2", number, GEMM_8B,
            f"results[M=128,provider={provider}].TBps", agg=agg)
      for number, provider, agg in [("1.0", "scaled_mm", "min"), ("2.5", "scaled_mm", "max"),
                                    ("1.8", "bf16", "min"), ("3.2", "bf16", "max")]],
    # The GEMVs on by default served at 8 req/s; the fused MoE, Qwen3-30B-A3B end to end (an H100, 2026-12-07)
    Claim(CH17, "fell from 1.65 to 1.53 ms", "1.65", SERVING_H100 % "old", "results.0.tpot_ms.mean"),
    Claim(CH17, "fell from 1.65 to 1.53 ms", "1.53", SERVING_H100 % "new", "results.0.tpot_ms.mean"),
    *[Claim("benchmarks/README.md", phrase, number, SERVING_H100 % label, path)
      for phrase, label in [("| old main (8e43f2f) | 1.65 / 1.65 / 1.93 | 9.78 / 14.85 |", "old"),
                            ("| new main, the GEMVs on by default | 1.53 / 1.56 / 1.84 | 9.59 / 15.82 |", "new")]
      for number, path in zip(" / ".join(phrase.strip("| ").split(" | ")[1:]).split(" / "),
                              ["results.0.tpot_ms.mean", "results.0.tpot_ms.median", "results.0.tpot_ms.p99",
                               "results.0.ttft_ms.mean", "results.0.ttft_ms.p99"])],
    *[Claim("benchmarks/README.md", f"| {m:,} | {ms} |", ms, MOE_H100, f"results[M={m},provider=ours].ms")
      for m, ms in [(1, "0.0693"), (4, "0.131"), (16, "0.299"), (64, "0.419"), (4096, "1.11"), (16384, "3.03")]],
    Claim("benchmarks/README.md", "| 16,384 | 3.03 | 55% of matmul |", "55", MOE_H100,
          "results[M=16384,provider=ours].fraction_of_matmul", 100),
    Claim("benchmarks/README.md", "3,802 output tok/s in 35.2 s, 45% of the 15.9 s floor", "3,802", MOE_E2E_H100,
          "minivllm.output_tok_per_s"),
    Claim("benchmarks/README.md", "3,802 output tok/s in 35.2 s, 45% of the 15.9 s floor", "45", MOE_E2E_H100,
          "minivllm.fraction_of_floor", 100),
    Claim("benchmarks/README.md", "3,802 output tok/s in 35.2 s, 45% of the 15.9 s floor", "15.9", MOE_E2E_H100,
          "floor.seconds"),
    # The float32 verify step against a plain one (chapter 15, an H100, 2026-12-07)
    *[Claim(CH15, "a verify step of 5 rows took 1.8 ms on the device and a plain step 0.837 ms", number,
            SPEC_PROFILE_H100, path)
      for number, path in [("1.8", "step_trace[config=ngram k=4,step=verify].device_ms"),
                           ("0.837", "step_trace[config=none,step=decode].device_ms")]],
    Claim(CH15, "with an acceptance length of 4.96 gave 1.96x", "4.96", SPEC_PROFILE_H100,
          "speed[config=ngram k=4].acceptance_length"),
    Claim(CH15, "with an acceptance length of 4.96 gave 1.96x", "1.96", SPEC_PROFILE_H100,
          "speed[config=ngram k=4].vs_none"),
]


def claim_id(claim: Claim) -> str:
    return f"{Path(claim.doc).stem}:{claim.phrase}:{claim.number}"


@pytest.mark.parametrize("claim", CLAIMS, ids=claim_id)
def test_claim_matches_its_result_file(claim):
    text = doc_text(claim.doc)
    assert claim.phrase in text, f"{claim.doc} no longer says {claim.phrase!r}: update the claim or the text"
    assert claim.number in claim.phrase
    for result in {claim.result, claim.per_result or claim.result}:
        assert f"`{result}`" in text, f"{claim.doc} quotes {result} without naming it"
    data = json.loads((REPO / claim.result).read_text())
    value = lookup(data, claim.path, claim.agg)
    if claim.minus is not None:
        value = value - lookup(data, claim.minus, claim.agg)
    if claim.per is not None:
        per_data = json.loads((REPO / claim.per_result).read_text()) if claim.per_result else data
        value = value / lookup(per_data, claim.per, claim.agg)
    written = float(claim.number.replace(",", ""))
    assert abs(written - claim.scale * value) <= claim.tolerance, (
        f"{claim.doc}: {claim.phrase!r} says {claim.number}; {claim.result} {claim.path} gives "
        f"{claim.scale * value:.6g}")


# ---- claims from notebooks' committed outputs and from the code ----------------------------------------

def notebook_output(relative: str) -> str:
    cells = json.loads((REPO / relative).read_text())["cells"]
    return "".join("".join(out.get("text", "")) for cell in cells for out in cell.get("outputs", []))


def test_prefix_caching_times_are_the_notebooks():
    """Chapter 04 quotes its notebook's committed CPU run; a re-run that changes them must change it too."""
    text, output = doc_text("chapters/04_prefix_caching.md"), notebook_output("notebooks/04_prefix_caching.ipynb")
    prefill = {}
    for enabled, computed, cached in (("False", "3266", "0"), ("True", "578", "2688")):
        found = re.search(f"enable_prefix_caching={enabled}: prompt tokens computed {computed}, from cache {cached}, "
                          r"hit rate \d+%, prefill ([\d.]+) s", output)
        assert found, (enabled, output)
        prefill[enabled] = found.group(1)
        assert f"| {f'{int(computed):,}'} |" in text and f"{prefill[enabled]} s |" in text
    assert f"from {prefill['False']} s to {prefill['True']} s" in text and "578 prompt tokens instead of 3,266" in text


def test_decode_buffers_diagram_lists_the_buffers_vectors():
    """Chapter 07's DecodeBuffers diagram is the layout of `_VECTORS` in cuda_graphs.py, in its order."""
    source = (REPO / "minivllm" / "engine" / "cuda_graphs.py").read_text()
    vectors = re.search(r"^_VECTORS = \(([^)]*)\)", source, re.M).group(1)
    names = re.findall(r'"(\w+)"', vectors)
    assert "seq_order" in names
    layout = "[ " + " | ".join(names + ["block_tables"])
    assert layout in (REPO / "chapters" / "07_cuda_graphs.md").read_text()


def test_scheduler_chapter_says_what_step_returns_by_default():
    """step() returns running requests too under the default CUMULATIVE output kind (chapter 03)."""
    params = (REPO / "minivllm" / "sampling_params.py").read_text()
    assert "output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE" in params
    text = doc_text("chapters/03_scheduler.md")
    assert "default `output_kind=RequestOutputKind.CUMULATIVE`" in text
    assert "for every running request that got a token in it too" in text


def test_every_chapter_is_at_most_3000_words():
    """A chapter keeps the idea, the final figure, the plot, what to run and what to try (at most about 13
    minutes of reading); run histories live in benchmarks/README.md. Words as `wc -w` counts them."""
    chapters = sorted((Path(__file__).resolve().parents[1] / "chapters").glob("[0-9]*.md"))
    assert chapters
    long = {p.name: n for p in chapters if (n := len(p.read_text().split())) > 3000}
    assert not long, long


DOC_ANCHOR_LINK = re.compile(r"\]\(\.\./((?:benchmarks|kernels)/[\w-]+\.md)#([^)\s]+)\)")


def markdown_sections(relative: str) -> dict[str, str]:
    """GitHub anchor -> the text of that section (to the next heading of any level)."""
    parts = re.split(r"^(#{1,6} .*)$", (REPO / relative).read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", head.lstrip("#").strip().lower()).replace(" ", "-"): " ".join(body.split())
            for head, body in zip(parts[1::2], parts[2::2])}


def test_chapters_link_sections_that_exist():
    """A chapter that cites a section of benchmarks/README.md or kernels/TUNING.md as a figure's source
    links a heading that is there."""
    links = [(p.name, doc, anchor) for p in sorted((REPO / "chapters").glob("*.md"))
             for doc, anchor in DOC_ANCHOR_LINK.findall(p.read_text())]
    assert len(links) >= 5
    missing = [link for link in links if link[2] not in markdown_sections(link[1])]
    assert not missing, missing


def test_chunked_prefill_throughput_is_in_the_section_it_cites():
    """Chapter 11's end-to-end figures, which no result file holds, are those of the section it links."""
    anchor = "2026-12-01-sixth-run-prompt-step-cuda-graphs-chunked-prefill-on-by-default-offline"
    section = markdown_sections("benchmarks/README.md")[anchor]
    chapter = doc_text("chapters/11_chunked_prefill.md")
    assert f"benchmarks/README.md#{anchor})" in chapter
    for row in ("| minivllm, chunked prefill off | 5.76 | 23,244 |", "| minivllm, chunked prefill on | 5.30 | **25,266** |"):
        assert row in section
    assert "**25,266** output tok/s (5.30 s) | 23,244 (5.76 s) |" in chapter


WORDS_PER_MINUTE = 230
READING_ROW = re.compile(r"^\| *\d\d[a-z]? *\| *\[[^\]]*\]\((chapters/\d\d[a-z]?_[\w-]+\.md)\) *\| *(\d+) min *\|", re.M)


def stated_reading_minutes() -> dict[str, int]:
    """Chapter path -> the reading time HowToApproachvLLM.md's chapter table states for it."""
    table = (REPO / "HowToApproachvLLM.md").read_text()
    return {path: int(minutes) for path, minutes in READING_ROW.findall(table)}


def test_stated_reading_times_are_the_word_counts():
    """Each chapter's reading time in the map is its `wc -w` word count at 230 words a minute, rounded,
    within 2 minutes (so edits of a few paragraphs do not break it, a rewrite does); the range the map
    states in "How to work through a chapter" is the table's."""
    stated = stated_reading_minutes()
    chapters = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "chapters").glob("[0-9]*.md"))
    assert sorted(stated) == chapters, "every chapter, and only chapters, gets a reading time in the table"
    wrong = {}
    for path, minutes in stated.items():
        computed = round(len((REPO / path).read_text().split()) / WORDS_PER_MINUTE)
        if abs(minutes - computed) > 2:
            wrong[path] = f"states {minutes} min, {computed} min at {WORDS_PER_MINUTE} words a minute"
    assert not wrong, wrong
    span = f"({min(stated.values())} to {max(stated.values())} minutes"
    assert span in doc_text("HowToApproachvLLM.md"), f"the map's reading range should say {span}"


CHAPTER_MENTION = re.compile(r"\b[Cc]hapters? (\d\d[a-z]?)\b|\((\d\d[a-z]?)_[\w-]+\.md\)")


def chapter_order(number: str) -> float:
    """'04b' sits between 04 and 05."""
    return int(number[:2]) + (0.5 if number[2:] else 0.0)


def forward_references(text: str, own: str) -> list[str]:
    """Mentions of a later chapter that are not inside a one-line 'Later:' pointer (the pointer's
    sentence starts with 'Later:' or '(Later:'; the mention comes before that sentence ends)."""
    flat = " ".join(text.split())
    bad = []
    for match in CHAPTER_MENTION.finditer(flat):
        number = match.group(1) or match.group(2)
        if chapter_order(number) <= chapter_order(own):
            continue
        before = flat[:match.start()]
        pointer = max(before.rfind("Later:"), before.rfind("later:"))
        sentence_end = max(before.rfind(". "), before.rfind(".) "), before.rfind("\n"))
        if pointer < 0 or sentence_end > pointer:
            bad.append(flat[max(0, match.start() - 80):match.end() + 20])
    return bad


def test_early_chapters_point_forward_only_in_later_pointers():
    """Chapters 00-07 need only the chapters before them: a later chapter is named only in a one-line
    'Later: chapter NN ...' pointer, never as something the reader must already know."""
    early = [p for p in sorted((REPO / "chapters").glob("0[0-7]*.md"))]
    assert len(early) >= 9
    bad = {p.name: refs for p in early if (refs := forward_references(p.read_text(), p.name[:3].rstrip("_")))}
    assert not bad, "\n".join(f"{name}: ...{ref}..." for name, refs in bad.items() for ref in refs)


def test_forward_reference_check_is_not_vacuous():
    assert forward_references("The default is on, chapter 11.", "03")
    assert forward_references("Later: see below. Chapter 11 does it.", "03")
    assert not forward_references("Later: chapter 11 mixes them.", "03")
    assert not forward_references("(Later: [chapter 11](11_chunked_prefill.md) explains it.)", "03")
    assert not forward_references("As chapter 02 showed.", "03")
    assert forward_references("the store (chapter 04b) writes", "04")
