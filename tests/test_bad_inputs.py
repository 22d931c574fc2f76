"""Bad input: every bad engine argument, prompt or sampling parameter is an error naming it and what
is allowed, raised before anything is queued (SamplingParams' own table: test_sampling_params.py)."""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minivllm import LLM, SamplingParams

ENGINE_ARGS = dict(device="cpu", max_model_len=512, max_num_batched_tokens=2048, max_num_seqs=16, kvcache_block_size=16)
NO_CUDA = not torch.cuda.is_available()


def positive_int_cases(name):
    allowed = f"{name} must be an int >= 1"
    return [({name: 0}, allowed), ({name: -3}, allowed), ({name: 2.0}, allowed), ({name: True}, allowed),
            ({name: "8"}, allowed)]


def bool_cases(name):
    return [({name: "yes"}, f"{name} must be True or False"), ({name: 1}, f"{name} must be True or False"),
            ({name: None}, f"{name} must be True or False")]


BAD_ENGINE_ARGS = [
    ({"max_num_seq": 4}, r"unknown engine arguments \['max_num_seq'\]; valid ones: \["),
    ({"model": None}, "model must be a local Hugging Face model directory"),
    ({"dtype": torch.int8}, r"dtype must be 'auto', one of \["),
    ({"dtype": torch.float64}, "dtype must be 'auto', one of"),
    ({"dtype": "int8"}, "dtype must be 'auto', one of"),
    ({"dtype": None}, "dtype must be 'auto', one of"),
    pytest.param({"device": "cuda"}, r"device='cuda' but CUDA is not available",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA is available here")),
    ({"device": "cuda:99"}, r"device='cuda:99' but"),
    ({"max_prompt_graph_tokens": -1}, r"max_prompt_graph_tokens must be an int >= 0, got -1"),
    ({"max_prompt_graph_tokens": 1.5}, r"max_prompt_graph_tokens must be an int >= 0, got 1.5"),
    ({"device": "tpu"}, r"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    ({"device": "cuda:x"}, r"device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    ({"device": None}, r"device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    *positive_int_cases("max_num_seqs"),
    *positive_int_cases("max_num_batched_tokens"),
    *positive_int_cases("tensor_parallel_size"),
    *positive_int_cases("cpu_kvcache_space_bytes"),
    ({"max_num_batched_tokens": 100, "enable_chunked_prefill": False},
     "max_num_batched_tokens=100 must be >= max_model_len=512 when chunked prefill is off"),
    ({"max_model_len": 0}, "max_model_len must be an int >= 1 or None"),
    ({"max_model_len": 64.0}, "max_model_len must be an int >= 1 or None"),
    ({"max_model_len": 10**6, "max_num_batched_tokens": 10**6}, "exceeds the model's max_position_embeddings="),
    ({"num_kvcache_blocks": 0}, "num_kvcache_blocks must be an int >= 1 or None"),
    ({"num_kvcache_blocks": 8.5}, "num_kvcache_blocks must be an int >= 1 or None"),
    ({"num_kvcache_blocks": 8}, "one sequence of max_model_len=512 needs 32"),
    ({"kvcache_block_size": 24}, r"kvcache_block_size must be a power of two in 1..256 \(an int\), got 24"),
    ({"kvcache_block_size": 16.0}, r"kvcache_block_size must be a power of two in 1..256 \(an int\), got 16.0"),
    ({"kvcache_block_size": 512}, "kvcache_block_size must be a power of two in 1..256"),
    ({"kvcache_block_size": 0}, "kvcache_block_size must be a power of two in 1..256"),
    ({"kvcache_block_size": None}, "kvcache_block_size must be a power of two in 1..256"),
    ({"gpu_memory_utilization": 0}, r"gpu_memory_utilization must be a number in \(0, 1\]"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be a number in \(0, 1\]"),
    ({"gpu_memory_utilization": math.nan}, r"gpu_memory_utilization must be a number in \(0, 1\]"),
    ({"gpu_memory_utilization": "0.9"}, r"gpu_memory_utilization must be a number in \(0, 1\]"),
    *bool_cases("enforce_eager"),
    *bool_cases("compile_small_ops"),
    ({"small_batch_gemv": 1}, "small_batch_gemv must be None .auto., True or False"),
    ({"small_batch_gemv": "on"}, "small_batch_gemv must be None .auto., True or False"),
    *bool_cases("enable_prefix_caching"),
    ({"async_scheduling": 1}, "async_scheduling must be None .auto., True or False"),
    ({"async_scheduling": "on"}, "async_scheduling must be None .auto., True or False"),
    ({"attention_backend": "cuda-magic"}, r"attention_backend must be one of \('torch', 'triton'\) or 'auto'"),
    ({"attention_backend": None}, r"attention_backend must be one of"),
    ({"seed": -1}, "seed must be an int >= 0"),
    ({"seed": 1.5}, "seed must be an int >= 0"),
    ({"tokenizer": 5}, "tokenizer must be a local tokenizer directory"),
    ({"tokenizer": "/no/such/tokenizer"}, "tokenizer must be a local tokenizer directory"),
    ({"skip_tokenizer_init": "yes"}, "skip_tokenizer_init must be a bool"),
    ({"eos_token_id": -1}, "eos_token_id must be an int >= 0 or None"),
    ({"eos_token_id": 10**9}, r"eos_token_id must be in \[0, \d+\) \(the model's vocab_size\)"),
]


@pytest.mark.parametrize("kwargs, message", BAD_ENGINE_ARGS)
def test_bad_engine_argument_is_named(qwen3_tiny_dir, kwargs, message):
    kwargs = {**ENGINE_ARGS, **kwargs}
    model = kwargs.pop("model", qwen3_tiny_dir)
    error = TypeError if "unknown engine arguments" in message else ValueError
    with pytest.raises(error, match=message):
        LLM(model, **kwargs)


def test_missing_model_directory_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"'.*nope' is not a directory"):
        LLM(str(tmp_path / "nope"))


def test_triton_backend_on_cpu_without_the_interpreter_says_what_to_set(qwen3_tiny_dir):
    """Triton picks its interpreter when the kernels are defined: without TRITON_INTERPRET=1 the
    engine must refuse at construction, not fail at the first generate."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    code = ("import sys; from minivllm import LLM\n"
            "try:\n"
            f"    LLM({qwen3_tiny_dir!r}, device='cpu', attention_backend='triton', max_model_len=64)\n"
            "except ValueError as e:\n"
            "    print(e); sys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "set the environment variable TRITON_INTERPRET=1 before Python imports triton" in proc.stdout
    assert "attention_backend='torch'" in proc.stdout


@pytest.fixture(scope="module")
def llm(qwen3_tiny_dir):
    return LLM(qwen3_tiny_dir, **ENGINE_ARGS)


def greedy(n=4, **kwargs):
    return SamplingParams(temperature=0.0, max_tokens=n, **kwargs)


def mutated(**changes):
    params = greedy()
    for name, value in changes.items():
        setattr(params, name, value)
    return params


BAD_REQUESTS = [  # (prompts, sampling_params, error, message)
    (None, greedy(), TypeError, "prompts must be a string, a list of token ids, a prompt dict, or a list of them"),
    (42, greedy(), TypeError, "prompts must be a string, a list of token ids, a prompt dict, or a list of them"),
    (["ok", None], greedy(), TypeError, "prompt 1: a prompt must be a string, a list of token ids .* got None"),
    ([True, False], greedy(), TypeError, r"prompt 0: .*bools are not token ids.*got True"),
    ([[1, True]], greedy(), TypeError, r"prompt 0: .*bools are not token ids.*got \[1, True\]"),
    ([[1, 2.0]], greedy(), TypeError, "prompt 0: a prompt must be a string, a list of token ids"),
    ([[1, "2"]], greedy(), TypeError, "prompt 0: a prompt must be a string, a list of token ids"),
    ([{"prompt_token_ids": [1, True]}], greedy(), TypeError, "prompt 0: .*bools are not token ids"),
    ([{"prompt_token_ids": []}], greedy(), ValueError, "prompt 0: the prompt is empty"),
    ([{"prompt": 5}], greedy(), TypeError, "prompt 0: a prompt dict's 'prompt' must be a string"),
    (["ok", {"text": "hi"}], greedy(), ValueError, "prompt 1: a prompt dict must have the key 'prompt'"),
    ([[1, 2], []], greedy(), ValueError, "prompt 1: the prompt is empty"),
    ("", greedy(), ValueError, "prompt 0: the prompt is empty"),
    ([[1, 2], [7] * 513], greedy(), ValueError, "prompt 1: the prompt has 513 tokens, more than max_model_len=512"),
    ([[10**9]], greedy(), ValueError, r"prompt 0: prompt token ids must be in \[0, \d+\)"),
    ([[3, -1]], greedy(), ValueError, r"prompt 0: prompt token ids must be in \[0, \d+\)"),
    ([[1], [2]], [greedy()], ValueError, "got 1 sampling_params for 2 prompts"),
    ([[1], [2]], [greedy(), {"temperature": 0}], TypeError, "prompt 1: sampling_params must be a SamplingParams, got dict"),
    ([[1]], {"temperature": 0}, TypeError, "sampling_params must be a SamplingParams or a list of them, got dict"),
    ([[1], [2]], [greedy(), mutated(max_tokens=0)], ValueError, "prompt 1: max_tokens must be an int >= 1, got 0"),
    ([[1]], mutated(top_k=0), ValueError, "prompt 0: top_k must be -1 .off. or a positive int, got 0"),
    ([[1]], mutated(temperature=-1), ValueError, "prompt 0: temperature must be"),
    ([[1]], mutated(n=0), ValueError, "prompt 0: n must be"),
    ([[1]], mutated(stop="\n", stop_token_ids=[1, None]), ValueError, "prompt 0: stop_token_ids must be"),
    ([[1]], greedy(stop_token_ids=[10**9]), ValueError, r"prompt 0: stop_token_ids must be in \[0, \d+\)"),
]


@pytest.mark.parametrize("prompts, params, error, message", BAD_REQUESTS)
def test_bad_request_is_named_and_nothing_is_queued(llm, prompts, params, error, message):
    with pytest.raises(error, match=message):
        llm.generate(prompts, params, use_tqdm=False)
    assert not llm.has_unfinished_requests() and not llm.output_processor.requests
    assert llm.scheduler.kv_cache_manager.num_free_blocks == llm.scheduler.kv_cache_manager.num_blocks


def test_add_request_rechecks_sampling_params(llm):
    params = greedy()
    params.max_tokens = 0  # after construction
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1, got 0"):
        llm.add_request([1, 2], params)
    assert not llm.has_unfinished_requests()


@pytest.mark.parametrize("messages", ["hi", [{"role": "user", "content": "hi"}, "hi"], [[]], [["hi"]], None])
def test_bad_chat_messages_are_named(llm, messages):
    with pytest.raises(TypeError, match="messages must be a conversation"):
        llm.chat(messages, greedy(), use_tqdm=False)
    assert not llm.has_unfinished_requests()
