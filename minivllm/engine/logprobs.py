"""Log-probabilities for the outputs: of each sampled token and the top-k beside it, and of every
prompt token a request asks for (`prompt_logprobs`).

Both are the model's raw log_softmax, before temperature, penalties and top-k/top-p, as vLLM returns
by default. Prompt logprobs need the logits of every prompt position: `PromptLogprobs` (a ModelRunner
layer) computes them chunk by chunk, PROMPT_LOGPROBS_CHUNK rows of the vocabulary at a time, and
hands them to the step's SamplerOutput.
vLLM: vllm/v1/outputs.py (LogprobsTensors), vllm/v1/worker/gpu_model_runner.py (_get_prompt_logprobs_dict).
"""
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from minivllm.core.device import to_device
from minivllm.core.model_runner import StepInputs
from minivllm.core.sequence import Sequence

PROMPT_LOGPROBS_CHUNK = 1024  # prompt positions whose vocabulary-wide logprobs are held at once


@dataclass
class LogprobsTensors:
    """Log-probabilities of chosen tokens and of the top-k, one row per position."""

    logprob_token_ids: torch.Tensor  # [rows, 1 + k] int64: the chosen token, then the top-k
    logprobs: torch.Tensor  # [rows, 1 + k] float32
    ranks: torch.Tensor  # [rows] int64: the chosen token's 1-based rank in the vocabulary

    def to_host(self, pin: bool) -> "LogprobsTensors":
        """Copies started toward the host (pinned, non-blocking on CUDA): valid once the stream has
        passed this point."""
        copies = []
        for t in (self.logprob_token_ids, self.logprobs, self.ranks):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            copies.append(host.copy_(t, non_blocking=pin))
        return LogprobsTensors(*copies)

    def tolists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        return self.logprob_token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()

    @classmethod
    def cat(cls, parts: list["LogprobsTensors"]) -> "LogprobsTensors":
        return cls(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls)))


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Raw logprobs: log_softmax of the model's logits in float32 (before any processing)."""
    return logits.float().log_softmax(dim=-1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """The chosen tokens' logprobs and ranks beside the top `num_logprobs` of every row.

    Args:
        logprobs: [rows, vocab] float32. token_ids: [rows] int64, the chosen token of each row.
    """
    token_ids = token_ids.to(torch.int64).unsqueeze(1)  # [rows, 1]
    chosen = logprobs.gather(1, token_ids)  # [rows, 1]
    ranks = (logprobs >= chosen).sum(dim=-1)  # ties count against the chosen token, as vLLM
    if num_logprobs == 0:
        return LogprobsTensors(token_ids, chosen, ranks)
    top = logprobs.topk(num_logprobs, dim=-1)
    return LogprobsTensors(torch.cat([token_ids, top.indices], dim=1), torch.cat([chosen, top.values], dim=1), ranks)


@dataclass
class PromptLogprobsInputs(StepInputs):
    """StepInputs plus the pieces of rows whose logits give prompt logprobs: (first row, rows), each
    one LM-head call (under tensor parallelism every rank makes the same calls, in this order)."""

    prompt_logprob_pieces: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int64))


def prompt_logprob_spans(out) -> list[tuple[Sequence, int, int, int]]:
    """(seq, first row in the packed step, first position, end position) of each chunk whose
    positions predict prompt tokens of a sequence that asked for prompt logprobs (position p's
    logits predict token p + 1; the last prompt position predicts a new token, not a prompt token)."""
    spans, row = [], 0
    for seq, num_tokens in zip(out.seqs, out.num_scheduled_tokens):
        start = seq.num_computed_tokens - num_tokens  # the chunk's first position
        end = min(seq.num_computed_tokens, seq.num_tokens - 1)
        if seq.sampling_params.prompt_logprobs is not None and seq.num_completion_tokens == 0 and end > start:
            spans.append((seq, row, start, end))
        row += num_tokens
    return spans


def _pieces(row: int, num_rows: int) -> list[tuple[int, int]]:
    return [(row + a, min(PROMPT_LOGPROBS_CHUNK, num_rows - a)) for a in range(0, num_rows, PROMPT_LOGPROBS_CHUNK)]


class PromptLogprobs:
    """ModelRunner layer: the logprobs of prompt tokens, computed from the step's hidden states."""

    step_inputs_class = PromptLogprobsInputs

    def prepare_inputs(self, out) -> PromptLogprobsInputs:
        inputs = super().prepare_inputs(out)
        self._spans = prompt_logprob_spans(out) if out.is_prefill else []
        pieces = [piece for _, row, start, end in self._spans for piece in _pieces(row, end - start)]
        return PromptLogprobsInputs(**{f.name: getattr(inputs, f.name) for f in fields(inputs)},
                                    prompt_logprob_pieces=np.array(pieces, dtype=np.int64).reshape(-1, 2))

    def compute_logits(self, batch, hidden: torch.Tensor) -> torch.Tensor:
        """The sampled rows' logits; also the LM head over every prompt-logprob piece (on rank 0,
        their logprobs, kept for `sample`; on other ranks, their share of the gather)."""
        pieces = [logits for row, n in batch.inputs.prompt_logprob_pieces.tolist()
                  for logits in [self.model.compute_logits(hidden[row:row + n])]]
        self._prompt_logprobs = self._gather_prompt_logprobs(pieces) if pieces and self.rank == 0 else None
        return super().compute_logits(batch, hidden)

    def _gather_prompt_logprobs(self, piece_logits: list[torch.Tensor]) -> dict[tuple[int, int], LogprobsTensors]:
        """(seq_id, first position) -> logprobs of the prompt tokens the step's chunks predict."""
        result, pieces = {}, iter(piece_logits)
        for seq, _, start, end in self._spans:
            assert seq.num_cached_tokens == 0, "prompt logprobs need every prompt position computed"
            next_ids = to_device(seq.token_ids[start + 1:end + 1], torch.int64, self.device)  # [end - start]
            parts = []
            for a, n in _pieces(0, end - start):
                parts.append(gather_logprobs(compute_logprobs(next(pieces)), next_ids[a:a + n],
                                             seq.sampling_params.prompt_logprobs))
            result[seq.seq_id, start] = LogprobsTensors.cat(parts)
        return result

    def sample(self, out, batch, logits):
        sampled = super().sample(out, batch, logits)
        sampled.prompt_logprobs = self._prompt_logprobs
        return sampled
