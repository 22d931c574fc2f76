"""The exercise switch: run a chapter's real tests against the learner's functions.

Every exercise is one component of the engine or of a kernel that the learner writes again: a function,
a class, or the few functions the engine splits it into, each with the same name and signature, in the
chapter's skeleton file (`chapters/exercises/exNN_*.py`). With

    MINIVLLM_EXERCISE=05          (every exercise of chapter 05; or 05.1 for one; or 03,04; or 04b)

in the environment, tests/conftest.py calls `install` before any test module is imported: each
engine function of the selected exercises is replaced by the skeleton's, in the module or class that
owns it and wherever a module of the package holds it under the same name. The tests then grade the
learner's code; the engine's own function is the solution. MINIVLLM_EXERCISE_SOLUTIONS=1 installs the
engine's functions instead (the check that the tests pass with the solutions).

`python -m chapters.exercises 05` (`make exercise CH=05`) runs the chapter's grading tests so.
"""
import importlib
import inspect
import os
import re
import sys
from dataclasses import dataclass

ENV_EXERCISE = "MINIVLLM_EXERCISE"
ENV_SOLUTIONS = "MINIVLLM_EXERCISE_SOLUTIONS"
# Imported before patching, so that every `from x import f` binding of a target is found and replaced.
PACKAGE_MODULES = ("minivllm.kernels", "minivllm.core.model_runner", "minivllm.core.scheduler",
                   "minivllm.core.kv_cache_manager", "minivllm.core.sampler", "minivllm.engine.sampler",
                   "minivllm.engine.cuda_graphs", "minivllm.engine.llm_engine", "minivllm.llm")


@dataclass(frozen=True)
class Exercise:
    number: str  # "05.1"
    # What the learner rewrites: "module:function", "module:Class.method" or "module:Class", or a tuple
    # of them for a component whose code the engine splits over several functions.
    target: str | tuple[str, ...]
    section: str  # the section of the chapter that explains it

    @property
    def targets(self) -> tuple[str, ...]:
        return (self.target,) if isinstance(self.target, str) else tuple(self.target)

    @property
    def names(self) -> tuple[str, ...]:
        """The skeleton's function or class for each target (the engine's name)."""
        return tuple(target.split(":")[1].split(".")[-1] for target in self.targets)

    @property
    def name(self) -> str:
        return self.names[0]


@dataclass(frozen=True)
class Chapter:
    number: str
    skeleton: str  # the learner's module
    chapter: str  # the chapter's file
    exercises: tuple[Exercise, ...]
    tests: tuple[str, ...]  # the grading tests: pytest node ids or files, from the repository root
    quick_tests: tuple[str, ...]  # a few of them, for the check in the normal suite


CHAPTERS = {c.number: c for c in [
    Chapter(
        "01", "chapters.exercises.ex01_the_model", "chapters/01_the_model.md",
        (Exercise("01.1", ("minivllm.layers.rotary_embedding:RotaryEmbedding",
                           "minivllm.layers.rotary_embedding:apply_rotary",
                           "minivllm.models.transformer:DecoderAttention.forward_qkv"), "RoPE"),),
        tests=("tests/test_rotary_embedding.py", "tests/test_kernels_rope.py",
               "tests/test_model_parity.py::test_logits_match_transformers"),
        quick_tests=("tests/test_rotary_embedding.py::test_each_pair_turns_by_its_angle",
                     "tests/test_rotary_embedding.py::test_scores_depend_only_on_the_distance",
                     "tests/test_rotary_embedding.py::test_the_layer_normalises_then_rotates_q_and_k",
                     "tests/test_kernels_rope.py::test_matches_reference")),
    Chapter(
        "02", "chapters.exercises.ex02_paged_kv_cache", "chapters/02_paged_kv_cache.md",
        (Exercise("02.1", ("minivllm.core.model_runner:ModelRunner.prepare_prefill",
                           "minivllm.core.model_runner:ModelRunner.prepare_decode",
                           "minivllm.core.model_runner:ModelRunner._slots",
                           "minivllm.core.model_runner:ModelRunner._block_tables"), "From block table to slot"),
         Exercise("02.2", "minivllm.core.kv_cache_manager:BlockPool", "KVCacheManager")),
        tests=("tests/test_prepare_inputs.py",
               "tests/test_engine.py::test_greedy_matches_transformers",
               "tests/test_engine.py::test_prefix_caching_same_outputs_and_hits",
               "tests/test_kv_cache_manager.py"),
        quick_tests=("tests/test_prepare_inputs.py::test_chunks_after_a_prefix_and_a_chunk_that_does_not_sample",
                     "tests/test_prepare_inputs.py::test_a_decode_step",
                     "tests/test_engine.py::test_greedy_matches_transformers[qwen3_tiny_dir]",
                     "tests/test_kv_cache_manager.py::test_block_pool_free_queue_order",
                     "tests/test_kv_cache_manager.py::test_allocate_share_append_free_hit_recycle"),
    ),
    Chapter(
        "03", "chapters.exercises.ex03_scheduler", "chapters/03_scheduler.md",
        (Exercise("03.1", ("minivllm.core.scheduler:Scheduler._schedule_waiting",
                           "minivllm.core.scheduler:Scheduler._schedule_decodes"), "Scheduler"),),
        tests=("tests/test_scheduler.py",),
        quick_tests=("tests/test_scheduler.py::test_the_newest_is_preempted_for_the_oldest",
                     "tests/test_scheduler.py::test_preemption_puts_the_newest_at_the_front_of_waiting",
                     "tests/test_scheduler.py::test_token_budget_counts_only_uncached_tokens",
                     "tests/test_scheduler.py::test_admission_is_first_come_first_served"),
    ),
    Chapter(
        "04", "chapters.exercises.ex04_prefix_caching", "chapters/04_prefix_caching.md",
        (Exercise("04.1", ("minivllm.core.kv_cache_manager:KVCacheManager.get_computed_blocks",
                           "minivllm.core.kv_cache_manager:KVCacheManager.allocate_slots",
                           "minivllm.core.kv_cache_manager:KVCacheManager.cache_blocks"),
                  "Chained block hashes"),),
        tests=("tests/test_kv_cache_manager.py", "tests/test_engine.py::test_prefix_caching_same_outputs_and_hits",
               "tests/test_scheduler.py::test_token_budget_counts_only_uncached_tokens",
               "tests/test_scheduler.py::test_chunked_prefix_hit_ends_mid_chunk_and_blocks_register_when_filled"),
        quick_tests=("tests/test_kv_cache_manager.py::test_allocate_share_append_free_hit_recycle",
                     "tests/test_kv_cache_manager.py::test_fully_cached_prompt_recomputes_its_last_block",
                     "tests/test_kv_cache_manager.py::test_hits_on_free_cached_blocks_take_them_from_the_free_queue",
                     "tests/test_kv_cache_manager.py::test_chunks_register_only_the_blocks_they_fill"),
    ),
    Chapter(
        "04b", "chapters.exercises.ex04b_triton_primer", "chapters/04b_triton_primer.md",
        (Exercise("04b.1", "minivllm.kernels.primer:vector_add_kernel", "2. Blocks and masks"),
         Exercise("04b.2", "minivllm.kernels.primer:softmax_rows_kernel", "4. One program per row: a fused softmax"),
         Exercise("04b.3", "minivllm.kernels.primer:matmul_kernel", "5. tl.dot and tiles"),
         Exercise("04b.4", "minivllm.kernels.primer:causal_tile_kernel", "6. A causal score tile")),
        tests=("tests/test_triton_primer.py",),
        quick_tests=("tests/test_triton_primer.py::test_vector_add[float32-3000]",
                     "tests/test_triton_primer.py::test_softmax_rows[float32-3-233]",
                     "tests/test_triton_primer.py::test_matmul[float32-233-40-70]",
                     "tests/test_triton_primer.py::test_causal_tile[float32-16-7-40]"),
    ),
    Chapter(
        "05", "chapters.exercises.ex05_flash_attention", "chapters/05_flash_attention.md",
        (Exercise("05.1", ("minivllm.kernels.flash_attn_varlen:_attend_kv_range",
                           "minivllm.kernels.flash_attn_varlen:causal_tile_bounds"),
                  "2. The online softmax (derive it once)"),),
        tests=("tests/test_kernels_prefill.py::test_causal_tile_bounds_visit_only_the_tiles_needed",
               "tests/test_kernels_prefill.py::test_ragged_batch_with_long_sequence",
               "tests/test_kernels_prefill.py::test_tile_configs",
               "tests/test_kernels_prefill.py::test_gqa_ratios_and_head_dims",
               "tests/test_kernels_prefill.py::test_more_keys_than_queries_and_fully_masked_rows",
               "tests/test_kernels_prefill.py::test_chunk_over_paged_prefix",
               "tests/test_kernels_prefill.py::test_chunk_over_paged_prefix_not_causal",
               "tests/test_kernels_fp8.py::test_prefix_hit_prefill_reads_fp8"),
        quick_tests=("tests/test_kernels_prefill.py::test_causal_tile_bounds_visit_only_the_tiles_needed",
                     "tests/test_kernels_prefill.py::test_more_keys_than_queries_and_fully_masked_rows",
                     "tests/test_kernels_prefill.py::test_chunk_over_paged_prefix_not_causal"),
    ),
    Chapter(
        "06", "chapters.exercises.ex06_paged_attention", "chapters/06_paged_attention.md",
        (Exercise("06.1", ("minivllm.kernels.paged_decode:_attend_split",
                           "minivllm.kernels.paged_decode:merge_splits_kernel"),
                  "5. Split-K (flash-decoding) and the merge"),),
        tests=("tests/test_kernels_decode.py::test_splits_read_the_context_once_and_evenly",
               "tests/test_kernels_decode.py::test_ragged_contexts",
               "tests/test_kernels_decode.py::test_several_query_tokens",
               "tests/test_kernels_decode.py::test_seq_order_changes_no_result",
               "tests/test_kernels_decode.py::test_gqa_ratios_and_head_dims",
               "tests/test_kernels_decode.py::test_large_scores_merge_without_overflow",
               "tests/test_kernels_fp8.py::test_decode_reads_fp8"),
        quick_tests=("tests/test_kernels_decode.py::test_splits_read_the_context_once_and_evenly",
                     "tests/test_kernels_decode.py::test_ragged_contexts[1-3]",
                     "tests/test_kernels_decode.py::test_large_scores_merge_without_overflow"),
    ),
    Chapter(
        "07", "chapters.exercises.ex07_cuda_graphs", "chapters/07_cuda_graphs.md",
        (Exercise("07.1", ("minivllm.engine.cuda_graphs:CUDAGraphRunner",
                           "minivllm.engine.cuda_graphs:DecodeCUDAGraphs.prepare_decode"),
                  "6. What graphs cost in memory, and sharing one pool"),),
        tests=("tests/test_cuda_graphs.py",),
        quick_tests=("tests/test_cuda_graphs.py::test_one_graph_per_size_captured_largest_first_in_one_pool",
                     "tests/test_cuda_graphs.py::"
                     "test_a_replay_reads_the_static_inputs_and_returns_rows_of_the_one_output_buffer",
                     "tests/test_cuda_graphs.py::"
                     "test_decode_inputs_are_written_into_the_static_buffer_padded_to_the_graph",
                     "tests/test_cuda_graphs.py::test_padding_rows_are_reset_whatever_an_earlier_step_left"),
    ),
    Chapter(
        "09", "chapters.exercises.ex09_sampling_kernel", "chapters/09_where_the_time_goes.md",
        (Exercise("09.1", ("minivllm.kernels.sampling:sample_chunks_kernel", "minivllm.kernels.sampling:_gumbel"),
                  "4. Sampling in one pass: the Gumbel-max trick"),),
        tests=("tests/test_sampling_kernel.py",),
        quick_tests=("tests/test_sampling_kernel.py::test_matches_reference_with_the_kernels_noise",
                     "tests/test_sampling_kernel.py::test_greedy_ties_go_to_the_smallest_index",
                     "tests/test_sampling_kernel.py::test_each_chunk_reports_its_best_score_and_its_smallest_id",
                     "tests/test_sampling_kernel.py::test_sampled_frequencies_follow_softmax_over_temperature"),
    ),
    Chapter(
        "13", "chapters.exercises.ex13_quantization", "chapters/13_quantization.md",
        (Exercise("13.1", ("minivllm.kernels.quant_fp8:kv_scale_from_amax", "minivllm.kernels.quant_fp8:quantize_fp8",
                           "minivllm.kernels.fp8_gemm:per_token_group_quant_fp8_kernel"),
                  "The format: e4m3 with a per-tensor scale"),),
        tests=("tests/test_kernels_fp8.py::test_round_trip_error_is_within_half_an_fp8_step",
               "tests/test_kernels_fp8.py::test_representable_values_survive_and_large_ones_saturate",
               "tests/test_kernels_fp8.py::test_kv_scale_maps_the_amax_onto_448_on_the_device",
               "tests/test_kernels_fp8.py::test_kernel_quantize_matches_torch_bit_for_bit",
               "tests/test_kernels_fp8.py::test_store_kvcache_writes_the_reference_codes",
               "tests/test_kernels_fp8.py::test_qk_norm_rope_store_writes_fp8",
               "tests/test_kernels_fp8_gemm.py::test_per_token_group_quant_kernel_is_the_reference_bit_for_bit",
               "tests/test_kernels_fp8_gemm.py::test_per_token_group_quant_reads_strided_rows",
               "tests/test_kernels_fp8_gemm.py::test_per_token_group_quant_rounds_every_code_and_midpoint",
               "tests/test_kernels_fp8_gemm.py::test_per_token_group_quant_maps_each_groups_amax_onto_448",
               "tests/test_fp8_kv_engine.py::test_fp8_cache_logits_close_and_greedy_tokens_mostly_equal"),
        quick_tests=("tests/test_kernels_fp8.py::test_kv_scale_maps_the_amax_onto_448_on_the_device",
                     "tests/test_kernels_fp8.py::test_kernel_quantize_matches_torch_bit_for_bit",
                     "tests/test_kernels_fp8_gemm.py::test_per_token_group_quant_rounds_every_code_and_midpoint",
                     "tests/test_kernels_fp8_gemm.py::test_per_token_group_quant_maps_each_groups_amax_onto_448"),
    ),
    Chapter(
        "14", "chapters.exercises.ex14_sampling", "chapters/14_sampling_and_outputs.md",
        (Exercise("14.1", ("minivllm.core.sampler:apply_top_k_top_p", "minivllm.core.sampler:apply_top_k_only",
                           "minivllm.core.sampler:Sampler"), "From logits to one token"),),
        tests=("tests/test_sampler.py", "tests/test_core_engine.py"),
        quick_tests=("tests/test_sampler.py::test_top_p_keeps_the_smallest_set_reaching_p",
                     "tests/test_sampler.py::test_top_k_keeps_every_tie_of_the_kth_logit",
                     "tests/test_sampler.py::test_core_sampler_top_k_alone_draws_from_the_renormalized_top_k",
                     "tests/test_sampler.py::test_core_sampler_divides_by_the_temperature_before_the_softmax",
                     "tests/test_sampler.py::test_core_draw_follows_the_probabilities"),
    ),
    Chapter(
        "15", "chapters.exercises.ex15_speculative_decoding", "chapters/15_speculative_decoding.md",
        (Exercise("15.1", ("minivllm.engine.ngram_proposer:NgramProposer",
                           "minivllm.engine.ngram_proposer:_continue"), "2. Prompt lookup: the n-gram proposer"),
         Exercise("15.2", "minivllm.engine.rejection_sampler:rejection_sample", "5. The rejection rule")),
        tests=("tests/test_spec_decode.py", "tests/test_spec_decode_exercises.py"),
        quick_tests=("tests/test_spec_decode_exercises.py::test_the_longest_suffix_wins_over_a_more_recent_shorter_one",
                     "tests/test_spec_decode_exercises.py::test_a_match_near_the_end_continues_with_its_period",
                     "tests/test_spec_decode_exercises.py::test_settings_are_checked_when_the_proposer_is_built",
                     "tests/test_spec_decode_exercises.py::test_accepted_prefix_exactly_where_p_and_q_decide_it",
                     "tests/test_spec_decode_exercises.py::test_every_emitted_token_follows_the_target_distribution"),
    ),
    Chapter(
        "16", "chapters.exercises.ex16_mixture_of_experts", "chapters/16_mixture_of_experts.md",
        (Exercise("16.1", "minivllm.kernels.fused_moe:moe_align_block_size",
                  "3. Sorting by expert: tiles of one expert"),),
        tests=("tests/test_moe_exercises.py", "tests/test_kernels_moe.py"),
        quick_tests=("tests/test_moe_exercises.py::test_the_chapters_picture",
                     "tests/test_moe_exercises.py::test_an_exact_multiple_of_block_m_takes_no_extra_tile",
                     "tests/test_moe_exercises.py::test_pairs_keep_their_order_within_an_expert",
                     "tests/test_moe_exercises.py::test_fused_moe_runs_on_the_alignment"),
    ),
    Chapter(
        "17", "chapters.exercises.ex17_small_batch_decode", "chapters/17_small_batch_decode.md",
        (Exercise("17.1", "minivllm.kernels.gemv:gemv_kernel", "3. A GEMV for a few rows"),),
        tests=("tests/test_kernels_gemv.py",
               "tests/test_small_batch.py::test_same_tokens_with_the_norms_and_silu_in_the_gemvs",
               "tests/test_small_batch.py::test_a_mixture_of_experts_folds_the_norm_into_qkv_only"),
        quick_tests=("tests/test_kernels_gemv.py::test_default_tiles_at_model_like_widths[1-add_rms_norm]",
                     "tests/test_kernels_gemv.py::test_each_prologue_rounds_where_the_layers_round[float16-rms_norm]",
                     "tests/test_kernels_gemv.py::test_split_k_counters_return_to_zero_and_calls_repeat_bit_for_bit",
                     "tests/test_kernels_gemv.py::test_the_last_split_sums_the_partials_in_split_order"
                     "[multiply_adds-add_rms_norm-launch_order-equal_splits]"),
    ),
]}


def _chapter_number(text: str) -> str:
    """'5' -> '05', '4B' -> '04b': two digits, then the letter of a chapter between two others."""
    match = re.fullmatch(r"(\d+)([a-z]?)", text.lower())
    return match.group(1).zfill(2) + match.group(2) if match else text


def select(spec: str) -> list[tuple[Chapter, Exercise]]:
    """'05' -> chapter 05's exercises; '05.1' -> that one; '03,04' -> both chapters'."""
    selected = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        chapter_number = _chapter_number(item.split(".")[0])
        chapter = CHAPTERS.get(chapter_number)
        if chapter is None:
            raise ValueError(f"no exercises for chapter {item!r}; chapters with exercises: {', '.join(CHAPTERS)}")
        number = f"{chapter_number}.{item.split('.')[1]}" if "." in item else None
        exercises = [e for e in chapter.exercises if number is None or e.number == number]
        if not exercises:
            raise ValueError(f"chapter {chapter_number} has no exercise {item!r}: "
                             f"{', '.join(e.number for e in chapter.exercises)}")
        selected += [(chapter, e) for e in exercises]
    return selected


def _resolve(target: str):
    """(owner, attribute name, the engine's function) of 'module:function' or 'module:Class.method'."""
    module_name, qualname = target.split(":")
    owner = importlib.import_module(module_name)
    *owner_path, name = qualname.split(".")
    for part in owner_path:
        owner = getattr(owner, part)
    return owner, name, inspect.getattr_static(owner, name)


def _python_function(fn):
    """The Python function under a @triton.jit (JITFunction.fn) or compile wrapper."""
    return getattr(fn, "fn", fn)


def _check_signature(exercise: Exercise, target: str, engine_fn, skeleton_fn, skeleton_module: str) -> None:
    expected = inspect.signature(_python_function(engine_fn))
    actual = inspect.signature(_python_function(skeleton_fn))
    if list(expected.parameters) != list(actual.parameters):
        name = target.split(":")[1].split(".")[-1]
        raise TypeError(f"exercise {exercise.number}: {skeleton_module}.{name} takes {actual}, "
                        f"the engine's {target} takes {expected}: keep the engine's parameters")


def install(spec: str, solutions: bool = False) -> list[str]:
    """Replace the engine functions of the exercises in `spec` by the skeletons' (or by themselves,
    with `solutions`). Returns one line per replacement, for the test report's header."""
    for name in PACKAGE_MODULES:
        importlib.import_module(name)
    lines = []
    for chapter, exercise in select(spec):
        for target in exercise.targets:
            owner, name, engine_fn = _resolve(target)
            skeleton_module = importlib.import_module(chapter.skeleton)
            skeleton_fn = getattr(skeleton_module, name, None)
            if skeleton_fn is None:
                raise AttributeError(f"exercise {exercise.number}: {chapter.skeleton} has no function {name}")
            _check_signature(exercise, target, engine_fn, skeleton_fn, chapter.skeleton)
            replacement = engine_fn if solutions else skeleton_fn
            setattr(owner, name, replacement)
            if inspect.ismodule(owner):  # `from module import name` copies elsewhere in the package
                for module in list(sys.modules.values()):
                    if (getattr(module, "__name__", "").startswith("minivllm")
                            and module.__dict__.get(name) is engine_fn):
                        setattr(module, name, replacement)
            source = "the engine's own code (solution)" if solutions else f"{chapter.skeleton}.{name}"
            lines.append(f"exercise {exercise.number}: {target} <- {source}")
    return lines


def install_from_environment() -> list[str]:
    """Called by tests/conftest.py: install what MINIVLLM_EXERCISE selects (nothing when unset)."""
    spec = os.environ.get(ENV_EXERCISE, "").strip()
    if not spec:
        return []
    return install(spec, solutions=os.environ.get(ENV_SOLUTIONS, "") not in ("", "0"))


def installs_learners_code() -> bool:
    """Does this process grade a learner's functions (MINIVLLM_EXERCISE set, not the solutions)? The
    tests that check a grader against known wrong answers build them on the engine's code: they skip."""
    return bool(os.environ.get(ENV_EXERCISE, "").strip()) and os.environ.get(ENV_SOLUTIONS, "") in ("", "0")


def unwritten_exercise_message(error: BaseException) -> str | None:
    """The messages of the skeletons' NotImplementedErrors behind `error` (through the exceptions
    that Triton's interpreter or the engine wrap them in, or raise while cleaning up after them),
    the first cause first; None if no unwritten exercise is involved."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.insert(0, error)
        error = error.__cause__ or error.__context__
    messages = [f"NotImplementedError: {e}" for e in chain
                if isinstance(e, NotImplementedError) and str(e).startswith("exercise ")]
    if not messages:  # compiled for a GPU, Triton rejects the skeleton's `raise` line and quotes it
        for e in chain:
            quoted = re.search(r"exercise (\d\d[a-z]?\.\d) \((\w+)\) is not written yet", str(e))
            if quoted is not None and quoted.group(1).split(".")[0] in CHAPTERS:
                chapter = CHAPTERS[quoted.group(1).split(".")[0]]
                section = next((x.section for x in chapter.exercises if x.number == quoted.group(1)), "")
                messages.append(f"NotImplementedError: {quoted.group(0)}: fill it in, "
                                f"{chapter.skeleton.replace('.', '/')}.py; read {chapter.chapter}, '{section}'")
    return "\n".join(dict.fromkeys(messages)) or None


def test_ids(spec: str, quick: bool = False) -> list[str]:
    """The grading tests of the chapters in `spec`, each once, in order."""
    ids = []
    for chapter, _ in select(spec):
        for test_id in (chapter.quick_tests if quick else chapter.tests):
            if test_id not in ids:
                ids.append(test_id)
    return ids
