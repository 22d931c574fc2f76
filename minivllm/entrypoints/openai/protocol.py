"""The OpenAI API's request bodies as pydantic models, their translation to SamplingParams, and the
error body every failure is answered with.

Fields an OpenAI client sends are typed here; unknown fields are ignored (as vLLM does), and values
the engine cannot honour are rejected with a message that names the field.
vLLM: vllm/entrypoints/openai/protocol.py.
"""
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse

from minivllm.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams


class OpenAIError(Exception):
    """A failure answered as the OpenAI API answers one: {"error": {"message", "type", "param", "code"}}
    with the HTTP status as `code` (vLLM's ErrorResponse)."""

    def __init__(self, message: str, status_code: int = 400, err_type: str = "BadRequestError",
                 param: str | None = None, headers: dict[str, str] | None = None):
        # A message that quotes the client's input may hold a lone surrogate, which UTF-8 cannot carry.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.message, self.status_code, self.err_type, self.param = message, status_code, err_type, param
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.status_code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


class UnsupportedFieldError(ValueError):
    """A request field this server parses but the engine cannot honour."""


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None

    def _num_logprobs(self) -> int | None:
        raise NotImplementedError

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams for this request (DELTA outputs: the server streams deltas).

        Raises:
            UnsupportedFieldError / ValueError: a value the engine rejects, with the field's name.
        """
        if self.logit_bias:
            raise UnsupportedFieldError("logit_bias is not supported")
        kwargs = dict(temperature=1.0 if self.temperature is None else self.temperature,
                      top_p=1.0 if self.top_p is None else self.top_p,
                      top_k=-1 if self.top_k is None or self.top_k == 0 else self.top_k,
                      max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                      stop=self.stop, stop_token_ids=self.stop_token_ids, seed=self.seed,
                      output_kind=RequestOutputKind.DELTA)
        for name, default in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            value = getattr(self, name)
            kwargs[name] = default if value is None else value
        return SamplingParams(n=self.n, logprobs=self._num_logprobs(), **kwargs)


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    # (token ids first: pydantic's smart union picks the same member in any order, but a long list of
    # ids tried against list[str] first costs an error per id: 140 ms for 650k ids instead of 10)
    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def _num_logprobs(self) -> int | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one string or token-id list each."""
        if self.echo:
            raise UnsupportedFieldError("echo is not supported")
        if self.suffix:
            raise UnsupportedFieldError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedFieldError("best_of other than n is not supported")
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        return list(prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise UnsupportedFieldError(f"message content of type {part.get('type')!r} is not supported")
            parts.append(part.get("text", ""))
        return "".join(parts)


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = None

    def _num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict]:
        if self.tools:
            raise UnsupportedFieldError("tools are not supported")
        return [{"role": m.role, "content": m.text()} for m in self.messages]

