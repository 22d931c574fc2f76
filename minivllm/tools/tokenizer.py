"""An offline tokenizer: byte-level BPE trained in under a second on text that ships with the repo.

Random-weight checkpoints need a real tokenizer and chat template, and nothing may come from a
model hub, so we train one (ChatML special tokens, a Qwen-style chat template, EOS `<|im_end|>`).
vLLM: vllm/transformers_utils/tokenizer.py loads tokenizers; vllm/v1/engine/detokenizer.py decodes.

Ids the tokenizer does not know (a model's vocab is rounded up past its tokenizer's, as Qwen3's
151936 > 151669) decode to nothing: `tokenizer.decode(ids)` (transformers), `Tokenizer.decode`
and `tokenizers.decoders.DecodeStream` skip them. Do NOT detokenize with
`convert_tokens_to_string(convert_ids_to_tokens(ids))`: unknown ids become None there and it raises.
"""
import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import tokenizers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

DATA_DIR = Path(__file__).parent / "data"
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # trained first, so their ids are 0, 1, 2
EOS_TOKEN, PAD_TOKEN = IM_END, ENDOFTEXT
TOKENIZER_VOCAB_SIZE = 8000  # the shipped text supports ~8030 merges-plus-bytes; 8000 is reached exactly
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# Qwen-style ChatML: each turn is `<|im_start|>{role}\n{content}<|im_end|>\n`; the generation
# prompt opens an assistant turn so the model's next tokens are the answer. No default system prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def minivllm_cache_dir() -> Path:
    """Where converted and generated artifacts are cached: $MINIVLLM_CACHE or ~/.cache/minivllm."""
    return Path(os.environ.get("MINIVLLM_CACHE") or Path.home() / ".cache" / "minivllm")


def training_files() -> list[Path]:
    files = sorted(p for p in DATA_DIR.iterdir() if p.is_file() and not p.name.startswith("."))
    if not files:
        raise FileNotFoundError(f"no tokenizer training text in {DATA_DIR}")
    return files


def train_tokenizer() -> Tokenizer:
    """Train the byte-level BPE from scratch (deterministic: same text, same tokenizer.json)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    # Byte-level: every string is bytes mapped to 256 printable symbols, so no text is ever <unk>.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE, min_frequency=1, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train([str(p) for p in training_files()], trainer=trainer)
    return tokenizer


def tokenizer_config() -> dict:
    """tokenizer_config.json, written by hand so it loads the same in transformers 4.x and 5.x."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,  # like Qwen: no BOS is prepended
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,  # decode(encode(text)) must give text back
        "model_max_length": 131072,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _cache_key() -> str:
    h = hashlib.sha256()
    for p in training_files():
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    recipe = [TOKENIZER_VOCAB_SIZE, SPECIAL_TOKENS, tokenizer_config(), tokenizers.__version__]
    h.update(json.dumps(recipe, sort_keys=True).encode())
    return h.hexdigest()[:16]


def _write_tokenizer_files(out_dir: Path) -> None:
    train_tokenizer().save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    special = {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "additional_special_tokens": [IM_START, IM_END]}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def get_tokenizer_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The trained tokenizer's files, trained once per cache dir (and looked up once per process)."""
    return _get_tokenizer_dir(Path(cache_dir) if cache_dir else minivllm_cache_dir())


@functools.lru_cache(maxsize=None)
def _get_tokenizer_dir(root: Path) -> Path:
    # Written to a temporary folder and renamed into place, so concurrent processes (pytest-xdist)
    # never see a half-written tokenizer; the loser of the race drops its identical copy.
    final = root / f"tokenizer-{_cache_key()}"
    if all((final / name).is_file() for name in TOKENIZER_FILES):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tokenizer-tmp-", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
    _write_tokenizer_files(tmp)
    try:
        os.rename(tmp, final)
    except OSError:  # another process renamed its copy first; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def save_tokenizer(out_dir: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> None:
    """Copy the tokenizer files (tokenizer.json, tokenizer_config.json, ...) into out_dir."""
    src = get_tokenizer_dir(cache_dir)
    for name in TOKENIZER_FILES:
        shutil.copyfile(src / name, Path(out_dir) / name)


@functools.lru_cache(maxsize=None)
def tokenizer_vocab_size() -> int:
    """Number of ids the tokenizer can decode (regular tokens plus the special tokens)."""
    return Tokenizer.from_file(str(get_tokenizer_dir() / "tokenizer.json")).get_vocab_size()
