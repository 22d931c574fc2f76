"""The composition root: the core plus the layers a Config asks for, assembled in one place.

    ModelRunner   the core's, with these layers over it (outermost first; each overrides the hooks
                  its module names, and calls on to the next):

        TensorParallel      the KV size all ranks hold; rank 0 broadcasts the inputs  executor.py
                            (outermost: a graph layer's replay does not call on, and every
                            step, replayed or not, must reach the other ranks)
        Fp8KVCache          FP8 cache and its scales; arms calculate_kv_scales last  fp8_kv.py
        PromptCUDAGraphs    prompt steps through piecewise CUDA graphs               prompt_graphs.py
        DecodeCUDAGraphs    decode steps as one CUDA graph each                       cuda_graphs.py
        CUDAWorker          device set-up, KV sized from memory, warm-ups             gpu_worker.py
        SplitMixedSteps     large mixed steps' decode rows through the decode kernel  mixed_steps.py
        AsyncOutputs        launch a step now, collect its tokens later               async_scheduling.py
        PromptLogprobs      logprobs of prompt tokens                                 logprobs.py
        SpecDecodeRunner    steps with draft tokens: verify them, the rejection rule  spec_decode.py
        FullSampler         penalties, seeds, logprobs, the fused draw                sampler.py
        FusedOps            fused q/k-norm + RoPE + KV store, SiLU, compiled norms    fused_ops.py
        SmallBatchGemv      single-token steps: GEMVs with the norms and SiLU in      small_batch.py
                            their prologues (small_batch_gemv; on by default on CUDA)

    Scheduler     the core's, with these layers over it (outermost first):

        SpecDecodeScheduler     draft tokens within the budget; roll back rejected  spec_decode.py
        AsyncScheduler          blocks a placeholder fills registered once known     async_scheduling.py
        ChunkedPrefillScheduler decodes and prompt chunks under one token budget     chunked_prefill.py

    Stepper       the core's SyncStepper, or AsyncStepper (SpecAsyncStepper with speculation)
    Executor      the ModelRunner itself on one device; MultiprocExecutor over N ranks

vLLM wires its optional pieces by configuration in a few such places (EngineArgs, Executor.get_class).
"""
import logging
import os

import torch

from minivllm.config import Config
from minivllm.core.engine import SyncStepper
from minivllm.core.model_runner import ModelRunner
from minivllm.core.scheduler import Scheduler

logger = logging.getLogger("minivllm")


def model_runner_class(config: Config) -> type:
    """The ModelRunner class for `config`: the core's with the layers it needs over it."""
    from minivllm.engine import async_scheduling, cuda_graphs, fp8_kv, fused_ops, gpu_worker, logprobs, mixed_steps
    from minivllm.engine import prompt_graphs, sampler, small_batch, spec_decode

    on_cuda = config.device.startswith("cuda")
    graphs = on_cuda and not config.enforce_eager and config.attention_backend == "triton"
    layers = [
        (_tensor_parallel(), config.tensor_parallel_size > 1),
        (fp8_kv.Fp8KVCache, config.kv_cache_torch_dtype != config.torch_dtype),
        (prompt_graphs.PromptCUDAGraphs, graphs and min(config.max_prompt_graph_tokens, config.max_num_batched_tokens) >= 16),
        (cuda_graphs.DecodeCUDAGraphs, graphs),
        (gpu_worker.CUDAWorker, on_cuda),
        (mixed_steps.SplitMixedSteps, config.enable_chunked_prefill and config.mixed_step_attention != "unified"),
        (async_scheduling.AsyncOutputs, config.async_scheduling),
        (logprobs.PromptLogprobs, True),
        (spec_decode.SpecDecodeRunner, config.spec_config is not None),
        (sampler.FullSampler, True),
        (fused_ops.FusedOps, True),
        (small_batch.SmallBatchGemv, config.small_batch_gemv),
    ]
    if on_cuda and not graphs and not config.enforce_eager:
        logger.info("CUDA graphs off: the %r attention backend syncs with the host", config.attention_backend)
    chosen = tuple(layer for layer, wanted in layers if wanted)
    return type("ModelRunner", (*chosen, ModelRunner), {"__doc__": ModelRunner.__doc__})


def _tensor_parallel():
    from minivllm.engine.executor import TensorParallel

    return TensorParallel


def build_model_runner(config: Config, device: torch.device, rank: int = 0) -> ModelRunner:
    if device.type == "cpu":
        leave_a_core_free(config.tensor_parallel_size)
    return model_runner_class(config)(config, device, rank)


def create_executor(config: Config):
    """One device: the ModelRunner itself. Several: rank 0 here, the other ranks in worker processes."""
    if config.tensor_parallel_size == 1:
        return build_model_runner(config, torch.device(config.device))
    from minivllm.engine.executor import MultiprocExecutor

    return MultiprocExecutor(config)


def scheduler_class(config: Config) -> type:
    """The Scheduler class for `config`: the core's with the layers it needs over it."""
    from minivllm.engine import async_scheduling, chunked_prefill, spec_decode

    layers = [
        (spec_decode.SpecDecodeScheduler, config.spec_config is not None),
        (async_scheduling.AsyncScheduler, config.async_scheduling),
        (chunked_prefill.ChunkedPrefillScheduler, config.enable_chunked_prefill),
    ]
    chosen = tuple(layer for layer, wanted in layers if wanted)
    return type("Scheduler", (*chosen, Scheduler), {"__doc__": Scheduler.__doc__})


def scheduler_and_stepper(config: Config) -> tuple[Scheduler, type]:
    from minivllm.engine.async_scheduling import AsyncStepper
    from minivllm.engine.spec_decode import SpecAsyncStepper

    stepper = SyncStepper
    if config.async_scheduling:
        stepper = SpecAsyncStepper if config.spec_config is not None else AsyncStepper
    return scheduler_class(config)(config), stepper


def leave_a_core_free(num_ranks: int = 1):
    """On the CPU, run torch's intra-op pool on all cores but one, shared between the tensor-parallel
    ranks (each rank is a process with a pool of its own), unless the user chose a count.

    torch's default pool spans every core, but the engine's Python loop (scheduling, bookkeeping,
    detokenizing) needs one too, and where other processes share the machine a pool as wide as the
    machine waits at each op's barrier for a descheduled thread: on a loaded 2-core machine the demo's
    60 prompts took 32-49 s with 1 thread and had not finished after 400 s with 2. Two ranks, each with
    a pool as wide as the machine, would contend for the same cores in the same way. vLLM's CPU backend
    likewise keeps a core for its front end. torch's thread count is process-wide, so a change is
    logged; OMP_NUM_THREADS or MKL_NUM_THREADS in the environment means the user chose, and nothing is
    changed.
    """
    if "OMP_NUM_THREADS" in os.environ or "MKL_NUM_THREADS" in os.environ:
        return
    num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    current = torch.get_num_threads()
    wanted = max(1, min(current, (num_cores - 1) // num_ranks))
    if wanted < current:
        torch.set_num_threads(wanted)
        logger.info("torch.set_num_threads(%d) (was %d on %d cores, %d rank(s)): one core left for the engine's "
                    "loop and other processes; set OMP_NUM_THREADS to choose", wanted, current, num_cores, num_ranks)
