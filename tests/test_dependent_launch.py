"""Programmatic dependent launch (kernels/_common.py, minivllm/engine/dependent_launch.py): the kernels
launch with it only inside the context and only as compiled CUDA kernels; every participating kernel
compiles for Hopper with the two instructions when on and without them when off; the option is refused
where it cannot run; on a Hopper GPU the same kernels and the same engine give the same bits with it
on and off, eagerly and replayed from CUDA graphs."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minivllm.kernels import _common
from minivllm.kernels._common import dependent_launches, pdl_launch_args, use_pdl

REPO = Path(__file__).resolve().parents[1]
CUDA = torch.device("cuda")
ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="programmatic dependent launch needs an sm_90+ GPU")


def test_kernels_launch_dependently_only_inside_the_context_and_on_cuda(monkeypatch):
    monkeypatch.setattr(_common, "is_interpreter", lambda: False)
    assert not use_pdl(CUDA) and pdl_launch_args(CUDA) == {}
    with dependent_launches():
        assert use_pdl(CUDA) and pdl_launch_args(CUDA) == {"USE_PDL": True, "launch_pdl": True}
        assert not use_pdl(torch.device("cpu"))
        with dependent_launches(False):
            assert not use_pdl(CUDA)
        assert use_pdl(CUDA)
    assert not use_pdl(CUDA)
    monkeypatch.setattr(_common, "is_interpreter", lambda: True)
    with dependent_launches():
        assert not use_pdl(CUDA), "the interpreter has no launch attributes"


def test_the_layer_runs_every_forward_of_the_model_under_the_context():
    from minivllm.engine.dependent_launch import launch_dependently

    class Probe(torch.nn.Module):
        def forward(self, x):
            return x + 1, _common._dependent_launches.get()

    model = launch_dependently(Probe())
    assert model(torch.zeros(1)) == (torch.ones(1), True)
    assert not _common._dependent_launches.get(), "the context ends with the forward"


def test_the_option_is_refused_where_it_cannot_run(qwen3_tiny_dir):
    from minivllm.config import Config

    if ON_HOPPER:
        pytest.skip("this machine can run it")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with pytest.raises(ValueError, match="dependent_launch=True: it needs"):
        Config(qwen3_tiny_dir, device=device, dependent_launch=True)


def test_every_participating_kernel_compiles_for_hopper_with_and_without():
    """tests/compile_for_hopper.py's pdl variants: Triton's compiler and ptxas for sm_90, no GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "compile_for_hopper.py"), "pdl"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("ok", "FAILED"))]
    assert proc.returncode == 0 and len(lines) == 8 and all(line.startswith("ok") for line in lines), (
        proc.stdout[-3000:] + proc.stderr[-3000:])


def _gemv_chain(x, weights, residual, norm_weight):
    """Four dependent GEMVs (split-K, a norm prologue with its residual), as a decode layer chains them."""
    from minivllm.kernels.gemv import gemv

    y, residual = gemv(x, weights[0], prologue="add_rms_norm", norm_weight=norm_weight, residual=residual)
    for w in weights[1:]:
        y = gemv(y, w)
    return y, residual


@needs_hopper
def test_dependent_gemvs_give_the_same_bits_eagerly_and_in_a_graph():
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = 1024

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=generator)

    x, residual, norm_weight = randn(1, hidden), randn(1, hidden), randn(hidden)
    weights = [randn(hidden, hidden) * 0.03 for _ in range(4)]
    expected = _gemv_chain(x, weights, residual, norm_weight)
    with dependent_launches():
        eager = _gemv_chain(x, weights, residual, norm_weight)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _gemv_chain(x, weights, residual, norm_weight)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip((*eager, *captured), (*expected, *expected)):
            assert torch.equal(got, want)


@needs_hopper
@pytest.mark.parametrize("small_batch_gemv", [False, True])
def test_the_engine_gives_the_same_tokens_with_dependent_launches(qwen3_tiny_dir, small_batch_gemv):
    """Greedy tokens of a few requests at once, CUDA graphs on (the decode steps are replays)."""
    from minivllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [dict(prompt_token_ids=list(range(5 + i, 40 + 3 * i))) for i in range(3)]
    results = []
    for dependent_launch in (False, True):
        llm = LLM(qwen3_tiny_dir, dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.3,
                  small_batch_gemv=small_batch_gemv, dependent_launch=dependent_launch)
        results.append([out.outputs[0].token_ids for out in llm.generate(prompts, params)])
        llm.shutdown()
    assert results[0] == results[1]
