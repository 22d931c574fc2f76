"""The offline API, shaped like vLLM's `LLM` so vLLM users feel at home.

    llm = LLM("path/to/model", max_num_seqs=64)
    outputs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))

vLLM: vllm/entrypoints/llm.py.
"""
from tqdm.auto import tqdm

from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

Prompt = str | list[int] | dict  # text, token ids, {"prompt": text} or {"prompt_token_ids": ids}


def _as_prompt_list(prompts) -> list[Prompt]:
    """One prompt (text, token ids or a prompt dict), or a list of prompts -> a list of prompts."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise TypeError(f"prompts must be a string, a list of token ids, a prompt dict, or a list of them; "
                    f"got {type(prompts).__name__}")


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
            use_tqdm: show a progress bar with prefill and decode throughput.
        """
        prompts = _as_prompt_list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        for prompt, sp in zip(prompts, params):  # validate everything before anything is scheduled
            self.validate_prompt(self.tokenize(prompt)[1])
            self._validate_params(sp)
        request_ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        outputs: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(prompts), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        try:
            while self.has_unfinished_requests():
                finished = self.step()
                outputs.update((out.request_id, out) for out in finished)
                bar.update(len(finished))
                bar.set_postfix_str(self._throughput_text(), refresh=False)
        except BaseException:
            self.abort_all()  # leave the engine usable for the next call
            raise
        finally:
            bar.close()
        return [outputs[str(rid)] for rid in request_ids]

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Apply the model's chat template and generate.

        Args:
            messages: one conversation (a list of {"role", "content"} dicts) or a list of conversations.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.get_tokenizer().apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      **(chat_template_kwargs or {}))
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    @staticmethod
    def _params_per_prompt(sampling_params, num_prompts: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        if len(sampling_params) != num_prompts:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {num_prompts} prompts")
        return list(sampling_params)

    def _throughput_text(self) -> str:
        s = self.stats
        prefill = s.num_prefill_tokens / s.prefill_seconds if s.prefill_seconds else 0.0
        decode = s.num_decode_tokens / s.decode_seconds if s.decode_seconds else 0.0
        return f"prefill {prefill:,.0f} tok/s, decode {decode:,.0f} tok/s"
