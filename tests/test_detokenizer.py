"""Incremental detokenization across split multi-byte characters, and stop strings."""
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from minivllm.engine.detokenizer import IncrementalDetokenizer, check_stop_strings

TEXT = "héllo wörld 你好 🙂 naïve café, 日本語のテキスト! ok 🙂🙂 end"


@pytest.fixture(scope="module")
def byte_level_tokenizer():
    """A tiny byte-level BPE (as GPT-2, Llama 3, Qwen): few merges, so multi-byte characters get split."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"], show_progress=False)
    tok.train_from_iterator(["héllo wörld 你好 hello world"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (as Llama 2): the decoder drops the first token's leading space."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<eos>"], show_progress=False)
    tok.train_from_iterator(["hello world the quick brown fox jumps over the lazy dog"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def stream(tokenizer, prompt_ids, completion_ids, **kwargs):
    """Feed completion_ids one by one; yield (detokenizer, delta) after each."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, **kwargs)
    for token_id in completion_ids:
        yield detok, detok.add(token_id)


def full_decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_split_characters_are_emitted_only_when_complete(byte_level_tokenizer):
    tok = byte_level_tokenizer
    prompt_ids = tok.encode("Say: ")
    completion_ids = tok.encode(TEXT)
    # The tokenizer really splits characters: some prefixes decode to a dangling U+FFFD.
    assert any(full_decode(tok, completion_ids[:i]).endswith("\ufffd") for i in range(len(completion_ids)))
    deltas = []
    for i, (detok, delta) in enumerate(stream(tok, prompt_ids, completion_ids), start=1):
        deltas.append(delta)
        assert "\ufffd" not in delta
        assert detok.text == full_decode(tok, completion_ids[:i]).rstrip("\ufffd")
    assert "".join(deltas) == detok.text == TEXT
    assert "" in deltas  # at least one token held back half a character


def test_random_ids_with_invalid_bytes_and_special_tokens(byte_level_tokenizer):
    """Random-weight models emit arbitrary ids: lone continuation bytes, <eos> mid-text, unknown ids."""
    tok = byte_level_tokenizer
    rng = random.Random(0)
    vocab_size = len(tok)
    prompt_ids = tok.encode("hello ")
    for _ in range(20):
        completion_ids = [rng.randrange(vocab_size + 50) for _ in range(40)]  # 50 ids past the tokenizer's vocab
        known = [i for i in completion_ids if i < vocab_size]
        for i, (detok, delta) in enumerate(stream(tok, prompt_ids, completion_ids), start=1):
            expected = full_decode(tok, [t for t in completion_ids[:i] if t < vocab_size])
            assert detok.text == expected.rstrip("\ufffd")
            if completion_ids[i - 1] >= vocab_size:
                assert delta == ""
        assert detok.token_ids == completion_ids and len(known) < len(completion_ids)


def test_skip_special_tokens_false_keeps_them(byte_level_tokenizer):
    tok = byte_level_tokenizer
    ids = tok.encode("hi") + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, tok.encode("x"), skip_special_tokens=False)
    text = "".join(detok.add(i) for i in ids)
    assert text == "hi<eos>"


def test_metaspace_keeps_spaces_between_tokens(metaspace_tokenizer):
    tok = metaspace_tokenizer
    prompt_ids = tok.encode("the quick")
    completion_ids = tok.encode(" brown fox jumps over the lazy dog")
    assert full_decode(tok, completion_ids) == "brown fox jumps over the lazy dog"  # the trap: decoding alone drops the space
    detok = IncrementalDetokenizer(tok, prompt_ids)
    for token_id in completion_ids:
        detok.add(token_id)
    assert full_decode(tok, prompt_ids + completion_ids) == full_decode(tok, prompt_ids) + detok.text
    assert detok.text == " brown fox jumps over the lazy dog"


def test_raw_tokenizers_tokenizer_works_too(byte_level_tokenizer):
    raw = byte_level_tokenizer.backend_tokenizer
    ids = raw.encode("你好 🙂").ids
    detok = IncrementalDetokenizer(raw, [])
    assert "".join(detok.add(i) for i in ids) == "你好 🙂"


@pytest.mark.parametrize("text, num_new, stop, cut", [
    ("hello world", 5, ["world"], 6),
    ("hello world", 3, ["lo w"], None),  # the match ended before the new characters
    ("hello world", 3, ["o wor"], 4),  # the match started before the new characters
    ("abcSTOPdefSTOP", 4, ["STOP"], 10),  # only the new occurrence counts
    ("a<|end|>b", 6, ["b", "<|end|>"], 1),  # earliest stop string wins
    ("hello", 2, [], None),
    ("hello", 0, ["o"], None),
])
def test_check_stop_strings(text, num_new, stop, cut):
    assert check_stop_strings(text, num_new, stop) == cut


def test_stop_string_split_across_tokens(byte_level_tokenizer):
    tok = byte_level_tokenizer
    completion_ids = tok.encode("hello wörld 你好 more text")
    detok = IncrementalDetokenizer(tok, [])
    for token_id in completion_ids:
        delta = detok.add(token_id)
        cut = check_stop_strings(detok.text, len(delta), ["ld 你"])
        if cut is not None:
            break
    assert detok.text[:cut] == "hello wör"


@pytest.mark.parametrize("tokenizer_fixture", ["byte_level_tokenizer", "metaspace_tokenizer"])
def test_tokens_added_in_chunks_give_the_streamed_text(request, tokenizer_fixture):
    """The engine decodes most requests once at the end (add_tokens): same text as token by token."""
    tok = request.getfixturevalue(tokenizer_fixture)
    rng = random.Random(1)
    prompt_ids = tok.encode("hello ")
    for _ in range(10):
        completion_ids = [rng.randrange(len(tok) + 5) for _ in range(30)]
        *_, (streamed, _) = stream(tok, prompt_ids, completion_ids)
        chunked = IncrementalDetokenizer(tok, prompt_ids)
        cut = rng.randrange(1, 30)
        chunked.add_tokens(completion_ids[:cut])
        chunked.add_tokens(completion_ids[cut:])
        assert chunked.text == streamed.text and chunked.token_ids == completion_ids


class _BytesTokenizer:
    """Token id -> raw bytes, decoded as a whole with U+FFFD for incomplete characters (byte-level BPE)."""

    pieces = [b"ab", "é".encode() + b"\xe4", b"\xbd\xa0", b"!"]  # "你" = e4 bd a0, split over ids 1 and 2

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")

    def get_vocab_size(self, with_added_tokens=True):
        return len(self.pieces)


def test_whole_characters_before_a_trailing_half_character_are_emitted():
    """A token that ends in half a character after whole ones: the whole ones come out at once (the
    final text of a sequence that ends there has them too), the half one when it is complete."""
    deltas = [delta for _, delta in stream(_BytesTokenizer(), [0], [0, 1, 2, 3])]
    assert deltas == ["ab", "é", "你", "!"]
    detok = IncrementalDetokenizer(_BytesTokenizer(), [])
    assert detok.add_tokens([0, 1]) == "abé" and detok.text == "abé"
