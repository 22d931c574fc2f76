"""The command line's engine flags, defined once for `minivllm serve` and `minivllm chat`: vLLM's flag
names, mapped onto minivllm's Config fields, and the model given as `MODEL` or `--model MODEL`.

Standard library only: `minivllm chat` imports it without the server's packages.
vLLM: vllm/engine/arg_utils.py (EngineArgs.add_cli_args, from_cli_args).
"""
import argparse

# flag -> Config field (vLLM's flag names; minivllm's field names)
ENGINE_FLAGS = {
    "dtype": "dtype", "device": "device", "max_model_len": "max_model_len", "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens", "gpu_memory_utilization": "gpu_memory_utilization",
    "block_size": "kvcache_block_size", "num_gpu_blocks_override": "num_kvcache_blocks",
    "enable_prefix_caching": "enable_prefix_caching", "enforce_eager": "enforce_eager",
    "async_scheduling": "async_scheduling", "tensor_parallel_size": "tensor_parallel_size",
    "attention_backend": "attention_backend", "seed": "seed", "tokenizer": "tokenizer",
    "enable_chunked_prefill": "enable_chunked_prefill", "max_prompt_graph_tokens": "max_prompt_graph_tokens",
    "mixed_step_attention": "mixed_step_attention", "kv_cache_dtype": "kv_cache_dtype", "quantization": "quantization",
    "speculative_config": "speculative_config", "small_batch_gemv": "small_batch_gemv",
}


def add_model_arg(parser: argparse.ArgumentParser):
    """The model directory, as `MODEL` (minivllm's and `vllm serve`'s spelling) or `--model MODEL`
    (vLLM's api_server module's); `resolve_model` checks that exactly one names it."""
    parser.add_argument("model", nargs="?", help="a local Hugging Face model directory")
    parser.add_argument("--model", dest="model_option", metavar="MODEL", default=None,
                        help="the same as the positional MODEL (give one of the two)")


def resolve_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Set args.model from MODEL or --model MODEL; exits with a usage error when neither is given or
    when the two name different directories."""
    positional, option = args.model, args.model_option
    if positional is None and option is None:
        parser.error("the model directory is missing: give it as MODEL or --model MODEL")
    if positional is not None and option is not None and positional != option:
        parser.error(f"two models given ({positional!r} and --model {option!r}): give one")
    args.model = positional if positional is not None else option
    return args


def add_engine_args(parser: argparse.ArgumentParser):
    """The engine flags (each maps to a Config field: ENGINE_FLAGS); unset ones keep Config's defaults."""
    e = parser.add_argument_group("engine")
    e.add_argument("--dtype", default=None)
    e.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=None)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--gpu-memory-utilization", type=float, default=None)
    e.add_argument("--block-size", type=int, default=None)
    e.add_argument("--num-gpu-blocks-override", type=int, default=None, help="KV-cache blocks (default: from memory)")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    e.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    e.add_argument("--enforce-eager", action="store_true", default=None)
    e.add_argument("--max-prompt-graph-tokens", type=int, default=None,
                   help="prompt steps of up to this many tokens replay piecewise CUDA graphs (0: eager)")
    e.add_argument("--mixed-step-attention", choices=["auto", "split", "unified"], default=None,
                   help="how a mixed step's decode rows attend (chunked prefill; default auto)")
    e.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default=None)
    e.add_argument("--quantization", choices=["fp8"], default=None, help="FP8 weights quantized at load time")
    e.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    e.add_argument("--small-batch-gemv", action=argparse.BooleanOptionalAction, default=None,
                   help="single-token steps through the small-batch GEMVs, norms and SiLU in their prologues")
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    e.add_argument("--attention-backend", default=None)
    e.add_argument("--seed", type=int, default=None, help="seed of the engine's sampler")
    e.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: the model's)")
    e.add_argument("--speculative-config", type=json_object, default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4}\'')


def json_object(text: str) -> dict:
    """An argparse type: a JSON object (a dict), anything else a usage error."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def engine_kwargs_from_args(args: argparse.Namespace) -> dict:
    """The Config fields the engine flags set (the flags left out keep Config's defaults)."""
    return {field: getattr(args, flag) for flag, field in ENGINE_FLAGS.items() if getattr(args, flag) is not None}
