"""minivllm: a small, readable reconstruction of the vLLM inference engine.

    from minivllm import LLM, SamplingParams

The names are resolved lazily so that `import minivllm` stays cheap (no torch import at import time).
"""
import os as _os

# `kernels/` lives at the top of the repository (see README, "Layout"). An installed minivllm
# carries it as `minivllm/kernels` (pyproject's package-dir). In a plain checkout used through
# PYTHONPATH=. (or an editable install) we let `minivllm.kernels` resolve to `<checkout>/kernels`.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "kernels")) and _os.path.isfile(
    _os.path.join(_checkout, "kernels", "__init__.py")
):
    __path__.append(_checkout)  # noqa: F821 (the package's own __path__)

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]


def __getattr__(name):
    if name == "LLM":
        from minivllm.llm import LLM

        return LLM
    if name == "SamplingParams":
        from minivllm.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput", "Logprob"):
        from minivllm import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'minivllm' has no attribute {name!r}")
