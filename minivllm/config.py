"""The engine's one configuration object, validated once in `__post_init__`.

Nothing writes a Config after construction. Two fields can only be settled later, by the engine:
`eos_token_id` (from the tokenizer when the model's config names none) and `num_kvcache_blocks`
(None: the ModelRunner sizes the cache from memory). The engine then makes a resolved copy with
`dataclasses.replace` (LLMEngine.config); the config the runner was built from keeps what was asked.

vLLM: vllm/config.py (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig in one here).
"""
import os
from dataclasses import dataclass, field, fields

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
           "half": torch.float16, "float": torch.float32}
ATTENTION_BACKENDS = ("torch", "triton")
MIXED_STEP_ATTENTION = ("auto", "split", "unified")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names; "fp8" is e4m3 (float8_e4m3fn)
LOAD_FORMATS = ("auto", "dummy")


SPEC_METHODS = ("ngram", "draft_model")
SPEC_VERIFY = ("decode", "prefill")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding's options (engine/spec_decode.py), from vLLM's `speculative_config` dict:
    LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
    "prompt_lookup_max": 4})."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2  # (ngram)
    prompt_lookup_max: int = 4  # (ngram)
    model: str | None = None  # (draft_model) the draft's directory: same tokenizer and vocabulary
    # How a step of decodes with drafts is verified: "decode" as one decode row per position (the
    # decode kernel and its CUDA graphs), "prefill" as a prefill step of 1 + k tokens per sequence;
    # steps with a prompt chunk always take the prefill path (engine/spec_decode.py)
    verify: str = "decode"
    # No drafts in a step with more decoding sequences than this (None: always draft). The default
    # is where drafts stopped paying on the H200 (benchmarks/README.md, speculative decoding).
    disable_by_batch_size: int | None = 16

    @classmethod
    def from_dict(cls, options) -> "SpeculativeConfig":
        if isinstance(options, cls):
            return options
        if not isinstance(options, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(options).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; valid ones: {sorted(names)}")
        if options.get("method") not in SPEC_METHODS:
                raise ValueError(f"speculative_config method must be one of {list(SPEC_METHODS)}, "
                             f"got {options.get('method')!r}")
        if "num_speculative_tokens" not in options:
            raise ValueError("speculative_config needs num_speculative_tokens (the draft length k >= 1)")
        return cls(**options)

    def __post_init__(self):
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            _check_int(name, getattr(self, name), minimum=1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        _check_int("disable_by_batch_size", self.disable_by_batch_size, minimum=1, optional=True)
        if self.verify not in SPEC_VERIFY:
            raise ValueError(f"speculative_config verify must be one of {list(SPEC_VERIFY)}, got {self.verify!r}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and os.path.isdir(self.model)):
            raise ValueError(f"speculative_config method 'draft_model' needs model: the draft's local directory, "
                             f"got {self.model!r}")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config model is for method 'draft_model'; 'ngram' drafts from the prompt")



@dataclass
class Config:
    model: str
    dtype: str | torch.dtype = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda when available, else cpu
    max_num_batched_tokens: int = 16384  # the token budget of one step
    # Split prompts across steps and mix decodes with prompt chunks. None: on (`minivllm serve` on a
    # GPU passes False unless told: see api_server.serving_chunked_prefill).
    enable_chunked_prefill: bool | None = None
    # How a mixed step (decode rows + prompt chunks) attends: "unified" (one varlen launch), "split"
    # (decode rows through the decode kernel), "auto" (unified up to 512 tokens: engine/mixed_steps.py)
    mixed_step_attention: str = "auto"
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped at 4096
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1  # ranks (GPUs) that split the model; rank 0 runs in this process
    enforce_eager: bool = False  # True: no CUDA graphs
    # Steps with prompt tokens of up to this many tokens replay piecewise CUDA graphs (everything but
    # attention, captured per token count: engine/prompt_graphs.py); 0: they run eagerly
    max_prompt_graph_tokens: int = 4096
    async_scheduling: bool | None = None  # None: on for CUDA; schedule step N+1 while N runs
    compile_small_ops: bool = True  # CUDA: RMSNorm+residual via torch.compile, SiLU-and-mul via a Triton kernel
    # None: on for CUDA; single-token steps run the linears as small-batch GEMVs with the norms and SiLU
    # in their prologues (engine/small_batch.py)
    small_batch_gemv: bool | None = None
    kvcache_block_size: int = 16
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; fp8 / fp8_e4m3: 1 byte per element, per-tensor scales
    calculate_kv_scales: bool = False  # FP8 KV: scales from the first prefill (amax / 448), not 1.0
    # None: the checkpoint's own (an FP8 checkpoint loads as FP8); "fp8": quantize the linear weights
    # to FP8 at load time (per-output-channel scales, per-token activation scales): W8A8
    quantization: str | None = None
    # "auto": the weights from the checkpoint's *.safetensors; "dummy" (vLLM's name): random weights drawn
    # on the device, no files read (a directory with config.json and a tokenizer is enough): for
    # benchmarks of shapes too large to write to disk
    load_format: str = "auto"
    num_kvcache_blocks: int | None = None  # None: sized from memory
    cpu_kvcache_space_bytes: int = 2 << 30  # CPU: KV cache budget (capped at what max_num_seqs x max_model_len fill)
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # auto: triton on CUDA, torch on CPU
    seed: int = 0
    tokenizer: str | None = None  # a tokenizer directory; None: the model's own
    skip_tokenizer_init: bool = False  # True: no tokenizer (token-id prompts only; output text is "")
    # Speculative decoding, vLLM's dict: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": a, "prompt_lookup_max": b} (engine/spec_decode.py); None: off
    speculative_config: dict | None = None
    hf_config: object = field(default=None, repr=False)  # derived: transformers config
    eos_token_id: int | None = None  # derived from the model directory
    torch_dtype: torch.dtype = field(default=None, repr=False)  # derived
    kv_cache_torch_dtype: torch.dtype = field(default=None, repr=False)  # derived from kv_cache_dtype
    quant_config: object = field(default=None, repr=False)  # derived: layers.quantization.Fp8Config or None
    spec_config: object = field(default=None, repr=False)  # derived: engine.spec_decode.SpeculativeConfig or None

    def __post_init__(self):
        self._check_arguments()
        from minivllm.models.loader import load_hf_config

        if self.hf_config is None:
            self.hf_config = load_hf_config(self.model)
        if not isinstance(self.skip_tokenizer_init, bool):
            raise ValueError(f"skip_tokenizer_init must be a bool, got {self.skip_tokenizer_init!r}")
        if self.tokenizer is None:
            self.tokenizer = self.model
        elif not isinstance(self.tokenizer, str) or not os.path.isdir(self.tokenizer):
            raise ValueError(f"tokenizer must be a local tokenizer directory; {self.tokenizer!r} is not a directory")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        on_cuda = self.device.startswith("cuda")
        if self.dtype == "auto":
            self.torch_dtype = torch.bfloat16 if on_cuda else torch.float32
        else:
            self.torch_dtype = _DTYPES.get(self.dtype, self.dtype)
        self.kv_cache_torch_dtype = self._kv_cache_torch_dtype(on_cuda)
        self.quant_config = self._quant_config(on_cuda)
        self.spec_config = self._spec_config()
        if self.async_scheduling is None:
            self.async_scheduling = on_cuda
        if self.attention_backend == "auto":
            self.attention_backend = "triton" if on_cuda else "torch"
        if self.attention_backend == "triton" and not on_cuda:
            _check_triton_interpreter("attention_backend='triton'", "or use attention_backend='torch'")
        if self.small_batch_gemv is None:
            self.small_batch_gemv = on_cuda
        if self.small_batch_gemv and not on_cuda:
            _check_triton_interpreter("small_batch_gemv=True", "or leave small_batch_gemv off")
        model_limit = getattr(self.hf_config, "max_position_embeddings", None) or 4096
        if self.max_model_len is None:
            self.max_model_len = min(model_limit, 4096)
        if self.max_model_len > model_limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={model_limit}")
        if self.enable_chunked_prefill is None:
            # On by default, as in vLLM: with prompt steps replayed as CUDA graphs it is no slower than
            # whole-prompt prefills on the H200, and it bounds every step (benchmarks/README.md).
            self.enable_chunked_prefill = True
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_model_len={self.max_model_len} "
                             "when chunked prefill is off (a whole prompt is prefilled in one step)")
        if self.tensor_parallel_size > 1:
            self._check_tensor_parallel()
        if self.eos_token_id is None:
            self.eos_token_id = getattr(self.hf_config, "eos_token_id", None)
            if isinstance(self.eos_token_id, list):
                self.eos_token_id = self.eos_token_id[0]
        elif self.eos_token_id >= self.hf_config.vocab_size:
            raise ValueError(f"eos_token_id must be in [0, {self.hf_config.vocab_size}) (the model's vocab_size), "
                             f"got {self.eos_token_id}")

    def _check_arguments(self):
        """Each argument's type and range, before anything is loaded (ValueError naming it)."""
        if not isinstance(self.model, (str, os.PathLike)) or not os.path.isdir(self.model):
            raise ValueError(f"model must be a local Hugging Face model directory; {self.model!r} is not a directory")
        self.model = os.fspath(self.model)
        if not (isinstance(self.dtype, str) and (self.dtype == "auto" or self.dtype in _DTYPES)
                or isinstance(self.dtype, torch.dtype) and self.dtype in _DTYPES.values()):
            raise ValueError(f"dtype must be 'auto', one of {sorted(_DTYPES)} or torch.float32 / float16 / bfloat16, "
                             f"got {self.dtype!r}")
        self._check_device()
        for name in ("max_num_batched_tokens", "max_num_seqs", "tensor_parallel_size", "cpu_kvcache_space_bytes"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("max_prompt_graph_tokens", self.max_prompt_graph_tokens, minimum=0)
        for name in ("max_model_len", "num_kvcache_blocks"):
            _check_int(name, getattr(self, name), minimum=1, optional=True)
        bs = self.kvcache_block_size
        if not _is_int(bs) or not 1 <= bs <= 256 or bs & (bs - 1):
            raise ValueError(f"kvcache_block_size must be a power of two in 1..256 (an int), got {bs!r}")
        u = self.gpu_memory_utilization
        if not isinstance(u, (int, float)) or isinstance(u, bool) or not 0.0 < u <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {u!r}")
        for name in ("enforce_eager", "compile_small_ops", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("async_scheduling", "small_batch_gemv"):
            if not (getattr(self, name) is None or isinstance(getattr(self, name), bool)):
                raise ValueError(f"{name} must be None (auto), True or False, got {getattr(self, name)!r}")
        if self.mixed_step_attention not in MIXED_STEP_ATTENTION:
            raise ValueError(f"mixed_step_attention must be one of {MIXED_STEP_ATTENTION}, got {self.mixed_step_attention!r}")
        if self.attention_backend not in ("auto", *ATTENTION_BACKENDS):
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS} or 'auto', got {self.attention_backend!r}")
        _check_int("seed", self.seed, minimum=0)
        _check_int("eos_token_id", self.eos_token_id, minimum=0, optional=True)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")

    def _kv_cache_torch_dtype(self, on_cuda: bool) -> torch.dtype:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "auto":
            if self.calculate_kv_scales:
                raise ValueError("calculate_kv_scales=True needs an FP8 KV cache (kv_cache_dtype='fp8')")
            return self.torch_dtype
        if on_cuda:
            check_fp8_supported(torch.device(self.device))
        return torch.float8_e4m3fn

    def _spec_config(self):
        """The checked speculative_config (a step with drafts waits for its tokens even with async
        scheduling on: engine/spec_decode.py's SpecAsyncStepper)."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_dict(self.speculative_config)

    def _quant_config(self, on_cuda: bool):
        """FP8 weights: the option and the checkpoint agree (get_quant_config), and on CUDA the card
        has FP8 tensor cores and the model runs in bfloat16 (the output dtype of the FP8 GEMMs)."""
        from minivllm.layers.quantization import get_quant_config

        quant_config = get_quant_config(self.quantization, self.hf_config)
        if quant_config is None or not on_cuda:
            return quant_config
        what = "an FP8 checkpoint" if quant_config.is_checkpoint_fp8 else "quantization='fp8'"
        check_fp8_supported(torch.device(self.device), what)
        if self.torch_dtype != torch.bfloat16:
            raise ValueError(f"{what} on CUDA needs dtype='bfloat16' (the FP8 GEMMs write bfloat16), got {self.torch_dtype}")
        return quant_config

    def _check_tensor_parallel(self):
        """Every rank must hold an equal share of the heads, the MLP and the vocabulary."""
        tp, hf = self.tensor_parallel_size, self.hf_config
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        splits = {"num_attention_heads": hf.num_attention_heads, "intermediate_size": hf.intermediate_size,
                  "vocab_size": hf.vocab_size}
        bad = [f"{name}={value}" for name, value in splits.items() if value % tp]
        if (num_kv_heads % tp) if tp < num_kv_heads else (tp % num_kv_heads):
            bad.append(f"num_key_value_heads={num_kv_heads} (needs a multiple or a divisor of the size)")
        if bad:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {', '.join(bad)}; "
                             f"choose a size that divides them")
        if self.device.startswith("cuda") and tp > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={tp} needs {tp} GPUs, this host has {torch.cuda.device_count()}")

    def _check_device(self):
        device = self.device
        if device == "auto" or device == "cpu":
            return
        if not isinstance(device, str) or not (device == "cuda" or device.startswith("cuda:")
                                                and device[5:].isdigit()):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available (torch {torch.__version__}, "
                             f"torch.cuda.is_available() is False); use device='cpu' or 'auto'")
        index = int(device[5:]) if device != "cuda" else 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r} but only {torch.cuda.device_count()} CUDA device(s) are visible")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_int(name: str, value, minimum: int, optional: bool = False):
    if optional and value is None:
        return
    if not _is_int(value) or value < minimum:
        allowed = f"an int >= {minimum}" + (" or None" if optional else "")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _check_triton_interpreter(option: str, alternative: str):
    """Triton kernels need a GPU; on a CPU they run in Triton's interpreter, which Triton chooses when
    the kernels are defined (at import), from the TRITON_INTERPRET environment variable."""
    from minivllm.kernels.store_kvcache import store_kvcache_kernel

    if type(store_kvcache_kernel).__name__ != "InterpretedFunction":
        raise ValueError(
            f"{option} on a CPU runs the kernels in Triton's interpreter: set the environment variable "
            f"TRITON_INTERPRET=1 before Python imports triton (e.g. `TRITON_INTERPRET=1 python ...`), {alternative}"
            + (" (TRITON_INTERPRET is set, but triton was imported before it was)"
               if os.environ.get("TRITON_INTERPRET") else ""))


# Paths that pass their CPU tests (torch and the Triton interpreter) but fail their GPU tests are
# refused on CUDA with this message rather than giving wrong answers. Setting the variable lets
# their GPU tests (and whoever fixes them) run them anyway.
def check_fp8_supported(device: torch.device, what: str = "kv_cache_dtype='fp8'"):
    """FP8 (e4m3) loads, stores, conversions and tensor-core dots need compute capability 8.9 (Ada) or newer."""
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(f"{what} needs a GPU with FP8 support (compute capability >= 8.9); "
                         f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")
