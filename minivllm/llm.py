"""The offline API, shaped like vLLM's `LLM` so vLLM users feel at home.

    llm = LLM("path/to/model", max_num_seqs=64)
    outputs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))

vLLM: vllm/entrypoints/llm.py.
"""
import copy
import time

from tqdm.auto import tqdm

from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.processor import is_token_id
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int] | dict  # text, token ids, {"prompt": text} or {"prompt_token_ids": ids}


def _as_prompt_list(prompts) -> list[Prompt]:
    """One prompt (text, token ids or a prompt dict), or a list of prompts -> a list of prompts."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(is_token_id(t) for t in prompts):
        return [list(prompts)]
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise TypeError(f"prompts must be a string, a list of token ids, a prompt dict, or a list of them; "
                    f"got {type(prompts).__name__}")


def _as_conversation_list(messages) -> list[list[dict]]:
    """One conversation (a list of message dicts) or a list of them -> a list of conversations."""
    def is_conversation(x):
        return isinstance(x, (list, tuple)) and all(isinstance(m, dict) for m in x)

    if is_conversation(messages) and messages:
        return [list(messages)]
    if isinstance(messages, (list, tuple)) and all(is_conversation(c) and c for c in messages):
        return [list(c) for c in messages]
    raise TypeError('messages must be a conversation (a list of {"role": ..., "content": ...} dicts) or a list '
                    f"of conversations, got {type(messages).__name__}")


def _with_output_kind(params: SamplingParams, kind: RequestOutputKind) -> SamplingParams:
    """A copy with another output_kind, not checked again here: check_request does that, naming the prompt."""
    params = copy.copy(params)
    params.output_kind = kind
    return params


class _TokenProgress:
    """generate()'s progress bar, counted in tokens: the total is the batch's max_tokens summed, and
    a request that stops early (EOS, a stop string) counts its unused budget when it finishes, so the
    bar ends full. The postfix has the requests finished so far and the engine's throughput.

    Counting the unfinished requests' tokens is a pass over them, so it runs at most every
    REFRESH_S seconds (and when requests finish), not after every step."""

    REFRESH_S = 0.1

    def __init__(self, engine, request_ids: list[str], params: list[SamplingParams], disable: bool):
        self.engine = engine
        self.max_tokens = {rid: sp.max_tokens * sp.n for rid, sp in zip(request_ids, params)}  # n samples each
        self.num_finished, self.finished_tokens, self.last_refresh = 0, 0, 0.0
        self.bar = tqdm(total=sum(self.max_tokens.values()), desc="Generating", unit="tok",
                        dynamic_ncols=True, disable=disable)

    def update(self, finished: list[RequestOutput]):
        if self.bar.disable:
            return
        for out in finished:
            self.num_finished += 1
            self.finished_tokens += self.max_tokens.get(out.request_id, 0)
        now = time.monotonic()
        if not finished and now - self.last_refresh < self.REFRESH_S:
            return
        self.last_refresh = now
        running = sum(sample.seq.num_completion_tokens for r in self.engine.output_processor.requests.values()
                      if r.request_id in self.max_tokens for sample in r.samples)
        self.bar.update(self.finished_tokens + running - self.bar.n)
        self.bar.set_postfix_str(f"{self.num_finished}/{len(self.max_tokens)} requests done, "
                                 f"{self.engine._throughput_text()}", refresh=False)

    def close(self):
        self.bar.close()


class LLM(LLMEngine):
    """An engine plus the batch `generate` / `chat` entry points.

    Args:
        model: a local Hugging Face model directory (config.json, *.safetensors, tokenizer files unless
            `tokenizer=` names another directory or `skip_tokenizer_init=True`).
        **kwargs: engine options, see `minivllm.config.Config` (dtype, device, max_num_seqs, ...).
    """

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for every prompt, batched; returns outputs in input order.

        Args:
            prompts: a string, a list of token ids, {"prompt": text}, {"prompt_token_ids": ids},
                or a list of them.
            sampling_params: one SamplingParams for all prompts, or one per prompt.
            use_tqdm: show a progress bar: tokens generated, requests finished, prefill and decode
                throughput.
        """
        prompts = _as_prompt_list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        for i, (prompt, sp) in enumerate(zip(prompts, params)):  # check everything before queuing anything
            try:
                self.check_request(prompt, sp)
            except (TypeError, ValueError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
        outputs: dict[str, RequestOutput] = {}
        progress = None
        try:  # queued inside the guard: whatever fails (a step, Ctrl-C) aborts every request queued
            request_ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
            progress = _TokenProgress(self, request_ids, params, disable=not use_tqdm)
            while self.has_unfinished_requests():
                finished = [out for out in self.step() if out.finished]
                outputs.update((out.request_id, out) for out in finished)
                progress.update(finished)
        except BaseException:
            self.abort_all()  # leave the engine usable for the next call
            raise
        finally:
            if progress is not None:
                progress.close()
        return [outputs[rid] for rid in request_ids]

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Apply the model's chat template and generate.

        Args:
            messages: one conversation (a list of {"role", "content"} dicts) or a list of conversations.
        """
        conversations = _as_conversation_list(messages)
        prompts = [self.get_tokenizer().apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      **(chat_template_kwargs or {}))
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    @staticmethod
    def _params_per_prompt(sampling_params, num_prompts: int) -> list[SamplingParams]:
        """One SamplingParams per prompt, asking for final outputs only (a batch call returns only
        those, and running requests then cost no detokenization)."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * num_prompts
        if not isinstance(sampling_params, (list, tuple)):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, "
                            f"got {type(sampling_params).__name__}")
        if len(sampling_params) != num_prompts:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {num_prompts} prompts")
        final_only = {}  # id(params) -> a FINAL_ONLY copy, made once per distinct object
        for sp in sampling_params:
            if id(sp) not in final_only:  # (not a SamplingParams: check_request names the error)
                keep = not isinstance(sp, SamplingParams) or sp.output_kind is RequestOutputKind.FINAL_ONLY
                final_only[id(sp)] = sp if keep else _with_output_kind(sp, RequestOutputKind.FINAL_ONLY)
        return [final_only[id(sp)] for sp in sampling_params]

    def _throughput_text(self) -> str:
        s = self.stats
        prefill = s.num_prefill_tokens / s.prefill_seconds if s.prefill_seconds else 0.0
        decode = s.num_decode_tokens / s.decode_seconds if s.decode_seconds else 0.0
        return f"prefill {prefill:,.0f} tok/s, decode {decode:,.0f} tok/s"
