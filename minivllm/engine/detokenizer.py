"""Turn generated token ids into text one token at a time, and find stop strings in it.

A byte-level BPE token can hold half of a multi-byte UTF-8 character, so text is only emitted
once a window of recent tokens decodes to complete characters (vLLM's prefix/read offsets).
vLLM: vllm/v1/engine/detokenizer.py and vllm/transformers_utils/detokenizer_utils.py.
"""

# How many already-emitted tokens to decode again as context: enough for decoders that treat a
# window's first token specially (SentencePiece drops its leading space) to agree with a full decode.
_NUM_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Streaming decode of one sequence's completion.

        all_ids:  ... prompt ... | c0 c1 c2 c3 c4 c5
                        ^prefix_offset   ^read_offset
        prefix_text = decode(all_ids[prefix_offset:read_offset])  (already emitted)
        new_text    = decode(all_ids[prefix_offset:])
        delta       = new_text[len(prefix_text):] up to a trailing incomplete character (U+FFFD);
                      the offsets move on once new_text ends in a complete character

    `tokenizer` is a transformers tokenizer or a `tokenizers.Tokenizer`. Ids the tokenizer does not
    know (a model's vocab is often padded past the tokenizer's) decode to "".
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        backend = getattr(tokenizer, "backend_tokenizer", None) or tokenizer  # fast path: the Rust tokenizer
        self._decode_fn = backend.decode
        self._vocab_size = (backend.get_vocab_size(with_added_tokens=True) if hasattr(backend, "get_vocab_size")
                            else len(tokenizer))
        self.skip_special_tokens = skip_special_tokens
        # Only the prompt's last few known ids are ever decoded again (as context): keep just those,
        # so that adding a long prompt costs nothing per prompt token.
        tail = []
        for i in reversed(prompt_token_ids):
            if len(tail) == _NUM_CONTEXT_TOKENS:
                break
            if self._known(i):
                tail.append(i)
        self.all_ids = tail[::-1]
        self.read_offset = len(self.all_ids)
        self.prefix_offset = max(self.read_offset - _NUM_CONTEXT_TOKENS, 0)
        self.text = ""
        self._emitted_past_read = 0  # characters emitted from tokens after read_offset (see add_tokens)
        self.token_ids: list[int] = []  # the completion as generated, unknown ids included

    def _known(self, token_id: int) -> bool:
        return 0 <= token_id < self._vocab_size

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" while a character is incomplete)."""
        return self.add_tokens([token_id])

    def add_tokens(self, token_ids: list[int]) -> str:
        """Add several generated tokens at once (one decode instead of one per token); return the new text.

        The engine feeds tokens one by one only to requests that need text as it grows (stop strings);
        the others are decoded once, when they finish.
        """
        self.token_ids += token_ids
        known = [t for t in token_ids if self._known(t)]
        if not known:
            return ""
        self.all_ids += known
        prefix_text = self._decode(self.all_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.all_ids[self.prefix_offset:])
        # Characters before a trailing incomplete one are final: emit them now (a token can end in
        # half a character after whole ones).
        delta = new_text.rstrip("\ufffd")[len(prefix_text) + self._emitted_past_read:]
        if new_text.endswith("\ufffd"):  # keep the offsets: the next tokens may complete it
            self._emitted_past_read += len(delta)
        elif len(new_text) > len(prefix_text):  # (not past a skipped special token alone)
            self.prefix_offset, self.read_offset = self.read_offset, len(self.all_ids)
            self._emitted_past_read = 0
        self.text += delta
        return delta


def check_stop_strings(text: str, num_new_chars: int, stop: list[str]) -> int | None:
    """Where to cut `text` if a stop string ends in its last `num_new_chars` characters.

    Returns:
        The index of the earliest stop string that the new characters complete (the text should
        become text[:index], without the stop string), or None.
    """
    found = find_stop_string(text, num_new_chars, stop)
    return None if found is None else found[0]


def find_stop_string(text: str, num_new_chars: int, stop: list[str]) -> tuple[int, str] | None:
    """`check_stop_strings`' cut index together with the stop string found there (vLLM's stop_reason)."""
    if not stop or num_new_chars <= 0:
        return None
    found = None
    for s in stop:
        # Only a match that ends inside the new characters is new; it can start before them.
        start = max(len(text) - num_new_chars - len(s) + 1, 0)
        index = text.find(s, start)
        if index != -1 and (found is None or index < found[0]):
            found = (index, s)
    return found
