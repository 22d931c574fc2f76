"""An OpenAI-compatible HTTP server on the async engine: FastAPI routes, SSE streaming, /metrics.

    minivllm serve MODEL_DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine flags]
    python -m minivllm.entrypoints.openai.api_server --model MODEL_DIR ...

    POST /v1/completions       POST /v1/chat/completions     (stream: true -> Server-Sent Events)
    GET  /v1/models            GET  /health                  GET /metrics (Prometheus)

Engine flags carry vLLM's names (--max-num-seqs, --gpu-memory-utilization, ...).
vLLM: vllm/entrypoints/openai/api_server.py, serving_completion.py, serving_chat.py.
"""
import argparse
import asyncio
import contextlib
import gc
import json
import logging
import math
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from minivllm.engine.async_llm import AsyncLLM, CoreOptions, EngineDeadError
from minivllm.entrypoints.arg_utils import add_engine_args, add_model_arg, engine_kwargs_from_args, resolve_model
from minivllm.entrypoints.openai.metrics import PrometheusStatLogger
from minivllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, OpenAIError,
                                                  _SamplingRequest)
from minivllm.entrypoints.openai.request_limits import DEFAULT_MAX_REQUEST_BYTES, RequestSizeLimitMiddleware
from minivllm.outputs import RequestOutput

logger = logging.getLogger("minivllm")


# ---- request bodies ------------------------------------------------------------------------------------
def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


def parse_body(body: bytes, model: type[BaseModel]) -> BaseModel:
    """A request's JSON body as `model`; a body that is not UTF-8, not JSON or not the model's shape is
    answered 400 with what to fix."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise OpenAIError(f"The request body is not valid UTF-8 (byte 0x{body[e.start]:02x} at offset {e.start}): "
                          "send the JSON encoded as UTF-8.") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise OpenAIError(f"The request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno}).") from None
    if not isinstance(data, dict):
        raise OpenAIError(f"The request body must be a JSON object ({{...}}), not a JSON {type(data).__name__}.")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise OpenAIError(_validation_message(e)) from None


# A tokenizer may normalize text first, and Unicode normalization can shrink it: NFC composes at most
# 3 bytes into 1 (Hangul jamo), NFKC 4 into 1 (U+107A5 MODIFIER LETTER SMALL Q -> "q").
MAX_NORMALIZED_SHRINK = 4


def max_bytes_per_token(tokenizer) -> int:
    """The most bytes of prompt text one token can stand for: the longest token of the vocabulary in
    UTF-8 as the vocabulary stores it (never shorter than its text in byte-level and SentencePiece
    vocabularies, which drop no text), times MAX_NORMALIZED_SHRINK if the tokenizer normalizes.
    A text of B bytes therefore has at least B / max_bytes_per_token(tokenizer) tokens."""
    longest = max(len(token.encode("utf-8")) for token in tokenizer.get_vocab())
    backend = getattr(tokenizer, "backend_tokenizer", None)  # None: a slow tokenizer (assume it normalizes)
    normalizes = backend is None or backend.normalizer is not None
    return longest * (MAX_NORMALIZED_SHRINK if normalizes else 1)


def _utf8_length(text: str, param: str) -> int:
    """The text's length in UTF-8 bytes; 400 if it holds a lone surrogate (JSON can carry "\\ud800",
    no tokenizer can encode it)."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise OpenAIError(f"{param} holds a lone surrogate ({text[e.start]!r} at character {e.start}), which is not "
                          "text: a character above U+FFFF is sent as a pair of surrogates (\\ud83d\\ude00), "
                          "never one alone.", param=param) from None


# ---- the serving logic ---------------------------------------------------------------------------------
@dataclass
class _Generation:
    """The engine requests one API request queued (one per prompt) and their merged outputs."""

    request_ids: list[str]
    prompt_lens: list[int]
    stream: AsyncIterator[tuple[int, RequestOutput]]  # (prompt index, output)


# Work on a request this small runs on the event loop: a hop to the preprocessing thread and back costs
# more than the work (the thread waits for the GIL, up to the 5 ms switch interval, while the loop runs),
# and a burst of hundreds of requests queues behind that one thread. Below these sizes the work takes
# well under a millisecond; above them it can take seconds and goes off the loop.
INLINE_BODY_BYTES = 64 * 1024  # JSON: a 1024-token id prompt is ~6 KB
INLINE_TEXT_BYTES = 4 * 1024   # text to tokenize or put in a chat template


class OpenAIServing:
    """Turns API requests into engine requests and engine outputs into API responses. Parsing large
    bodies, chat templates and tokenizing long texts run in a thread of their own (`off_loop`): a long
    prompt takes seconds to tokenize, and on the event loop that would stall every other client's stream
    (Hugging Face's tokenizers let go of the GIL while they encode). Small ones run on the loop
    (`preprocess`)."""

    def __init__(self, async_llm: AsyncLLM, served_model_name: str):
        self.async_llm = async_llm
        self.served_model_name = served_model_name
        self.max_model_len = async_llm.config.max_model_len
        self.tokenizer = async_llm.tokenizer
        self.input_processor = async_llm.input_processor
        self.max_bytes_per_token = max_bytes_per_token(self.tokenizer) if self.tokenizer is not None else None
        # One thread, as vLLM's tokenizer executor: a tokenizer called from two threads at once may raise
        # "Already borrowed". (JSON parsing holds the GIL; here the event loop runs between two bodies.)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-preprocess")

    def shutdown(self):
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn, *args):
        """fn(*args) in the preprocessing thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def preprocess(self, num_bytes: int, limit: int, fn, *args):
        """fn(*args) on the event loop if its input is at most `limit` bytes, else in the preprocessing
        thread."""
        if num_bytes <= limit:
            return fn(*args)
        return await self.off_loop(fn, *args)

    async def parse(self, raw_request: Request, model: type[BaseModel]) -> BaseModel:
        body = await raw_request.body()
        return await self.preprocess(len(body), INLINE_BODY_BYTES, parse_body, body, model)

    def check_model(self, model: str | None):
        if model is not None and model != self.served_model_name:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, "NotFoundError", "model")

    def _check_prompt_text(self, text: str, param: str) -> int:
        """Refuse, before tokenizing it, a text that is not text or that cannot fit in the context; its
        length in UTF-8 bytes."""
        num_bytes = _utf8_length(text, param)
        if self.max_bytes_per_token is not None and num_bytes > self.max_model_len * self.max_bytes_per_token:
            raise OpenAIError(f"The prompt is {num_bytes} bytes of text, so at least "
                              f"{math.ceil(num_bytes / self.max_bytes_per_token)} tokens, more than this model's "
                              f"maximum context length of {self.max_model_len} tokens. Please shorten it.", param=param)
        return num_bytes

    def _max_tokens(self, requested: int | None, num_prompt_tokens: int) -> int:
        room = self.max_model_len - num_prompt_tokens
        if requested is None:
            requested = room
        if requested < 1:
            raise OpenAIError(f"max_tokens must be at least 1, got {requested}.", param="max_tokens")
        if requested > room:
            raise OpenAIError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                              f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, "
                              f"{requested} for the completion). Please reduce the prompt or max_tokens.",
                              param="max_tokens")
        return requested

    def _tokenize(self, prompts: list) -> list[list[int]]:
        """(Off the loop.) The token ids of every prompt, each checked against the model."""
        token_lists = []
        for prompt in prompts:
            _, token_ids = self.input_processor.tokenize(prompt)
            self.input_processor.validate_prompt(token_ids)
            token_lists.append(token_ids)
        return token_lists

    async def _start(self, body: _SamplingRequest, prompts: list, max_tokens: int | None, request_id: str,
                     param: str) -> _Generation:
        """Check, tokenize and queue every prompt."""
        text_bytes = sum(self._check_prompt_text(prompt, param) for prompt in prompts if isinstance(prompt, str))
        token_lists = await self.preprocess(text_bytes, INLINE_TEXT_BYTES, self._tokenize, prompts)
        params = [body.to_sampling_params(self._max_tokens(max_tokens, len(ids))) for ids in token_lists]
        request_ids = [f"{request_id}-{i}" for i in range(len(token_lists))]
        streams = []
        try:
            for ids, sp, engine_request_id in zip(token_lists, params, request_ids):
                streams.append(self.async_llm.generate(ids, sp, engine_request_id))
        except BaseException:
            self._abort(request_ids)
            raise
        return _Generation(request_ids, [len(ids) for ids in token_lists], _merge(streams))

    def _abort(self, request_ids: list[str]):
        for request_id in request_ids:
            self.async_llm.abort(request_id)  # a finished request: nothing to do

    async def _gather_choices(self, generation: _Generation, n: int) -> list["_Choice"]:
        """Every choice in full. Leaving early (the client hung up: the handler is cancelled) aborts the
        generation's requests, which frees their KV blocks at once."""
        try:
            return await _collect(generation.stream, n)
        finally:
            self._abort(generation.request_ids)

    async def completions(self, body: CompletionRequest):
        self.check_model(body.model)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        generation = await self._start(body, body.prompts(), body.max_tokens, request_id, "prompt")
        prompt_lens = generation.prompt_lens
        header = dict(id=request_id, object="text_completion", created=int(time.time()), model=self.served_model_name)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse(self._completion_chunks(generation.stream, header, body.n, prompt_lens, include_usage,
                                                body.logprobs or 0))
        choices = await self._gather_choices(generation, body.n)
        return {**header, "choices": [self._completion_choice(i, c, body.logprobs or 0) for i, c in enumerate(choices)],
                "usage": _usage(prompt_lens, choices)}

    def _completion_choice(self, index: int, c: "_Choice", k: int) -> dict:
        return {"index": index, "text": c.text, "logprobs": self._completion_logprobs(c, k) if c.logprobs else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    async def _completion_chunks(self, stream, header, n, prompt_lens, include_usage, k) -> AsyncIterator[dict]:
        num_tokens = 0
        async for prompt_index, out in stream:
            for c in out.outputs:
                num_tokens += len(c.token_ids)
                if not c.text and c.finish_reason is None and not c.token_ids:
                    continue
                logprobs = self._completion_logprobs(_Choice.of(c), k) if c.logprobs else None
                yield {**header, "choices": [{"index": prompt_index * n + c.index, "text": c.text,
                                              "logprobs": logprobs, "finish_reason": c.finish_reason,
                                              "stop_reason": c.stop_reason}]}
        if include_usage:
            yield {**header, "choices": [], "usage": _usage_counts(sum(prompt_lens), num_tokens)}

    def _render_chat(self, body: ChatCompletionRequest, conversation: list[dict]) -> str:
        """(Off the loop.) The conversation as the model's chat template writes it."""
        try:
            return self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                      add_generation_prompt=body.add_generation_prompt,
                                                      **(body.chat_template_kwargs or {}))
        except Exception as e:  # ValueError, TypeError, KeyError, jinja2's TemplateError (raise_exception)
            raise OpenAIError(f"the chat template could not be applied: {e}", param="messages") from e

    async def chat(self, body: ChatCompletionRequest):
        self.check_model(body.model)
        conversation = body.conversation()
        text_bytes = sum(_utf8_length(message["content"], f"messages[{i}].content")
                         for i, message in enumerate(conversation))
        prompt = await self.preprocess(text_bytes, INLINE_TEXT_BYTES, self._render_chat, body, conversation)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        generation = await self._start(body, [prompt], body.requested_max_tokens(), request_id, "messages")
        prompt_lens = generation.prompt_lens
        header = dict(id=request_id, created=int(time.time()), model=self.served_model_name)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse(self._chat_chunks(generation.stream, header, prompt_lens, include_usage,
                                          body.top_logprobs or 0))
        choices = await self._gather_choices(generation, body.n)
        return {**header, "object": "chat.completion",
                "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                             "logprobs": self._chat_logprobs(c, body.top_logprobs or 0) if c.logprobs else None,
                             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                            for i, c in enumerate(choices)],
                "usage": _usage(prompt_lens, choices)}

    async def _chat_chunks(self, stream, header, prompt_lens, include_usage, k) -> AsyncIterator[dict]:
        header = {**header, "object": "chat.completion.chunk"}
        started, num_tokens = set(), 0
        async for _, out in stream:
            for c in out.outputs:
                num_tokens += len(c.token_ids)
                if c.index not in started:  # the first chunk of a choice names the role
                    started.add(c.index)
                    yield {**header, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]}
                if not c.text and c.finish_reason is None and not c.token_ids:
                    continue
                logprobs = self._chat_logprobs(_Choice.of(c), k) if c.logprobs else None
                yield {**header, "choices": [{"index": c.index, "delta": {"content": c.text}, "logprobs": logprobs,
                                              "finish_reason": c.finish_reason,
                                              "stop_reason": c.stop_reason}]}
        if include_usage:
            yield {**header, "choices": [], "usage": _usage_counts(sum(prompt_lens), num_tokens)}

    # ---- logprobs (the engine's CompletionOutput.logprobs: per token, {token_id: Logprob}) ----
    def _token_text(self, token_id: int, logprob) -> str:
        text = getattr(logprob, "decoded_token", None)
        return text if text is not None else self.tokenizer.decode([token_id])

    @staticmethod
    def _top(entry: dict, k: int) -> list[tuple[int, object]]:
        """The k most likely tokens of one position, most likely first."""
        ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                                       -kv[1].logprob))
        return ranked[:k]

    def _completion_logprobs(self, c: "_Choice", k: int) -> dict:
        """The legacy completions format: per token its text, logprob, and {text: logprob} of the
        sampled token and the k most likely (vLLM's)."""
        tokens, token_logprobs, top_logprobs, offsets, offset = [], [], [], [], 0
        for token_id, entry in zip(c.token_ids, c.logprobs):
            sampled = entry[token_id]
            text = self._token_text(token_id, sampled)
            tokens.append(text)
            token_logprobs.append(sampled.logprob)
            top = {text: sampled.logprob}
            top.update((self._token_text(t, lp), lp.logprob) for t, lp in self._top(entry, k))
            top_logprobs.append(top)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def _chat_logprobs(self, c: "_Choice", k: int) -> dict:
        """The chat format: per token its text, logprob, bytes, and the k most likely tokens."""
        content = []
        for token_id, entry in zip(c.token_ids, c.logprobs):
            sampled = entry[token_id]
            text = self._token_text(token_id, sampled)
            top = [{"token": self._token_text(t, lp), "logprob": lp.logprob,
                    "bytes": list(self._token_text(t, lp).encode())} for t, lp in self._top(entry, k)]
            content.append({"token": text, "logprob": sampled.logprob, "bytes": list(text.encode()),
                            "top_logprobs": top})
        return {"content": content}


class _Choice:
    """One choice accumulated from DELTA outputs."""

    def __init__(self):
        self.text, self.token_ids, self.logprobs = "", [], []
        self.finish_reason = self.stop_reason = None

    @classmethod
    def of(cls, c) -> "_Choice":
        choice = cls()
        choice.add(c)
        return choice

    def add(self, c):
        self.text += c.text
        self.token_ids += c.token_ids
        self.logprobs += c.logprobs or []
        self.finish_reason = c.finish_reason
        self.stop_reason = c.stop_reason


async def _collect(stream, n: int) -> list[_Choice]:
    choices: dict[int, _Choice] = {}
    async for prompt_index, out in stream:
        for c in out.outputs:
            choices.setdefault(prompt_index * n + c.index, _Choice()).add(c)
    return [choices[i] for i in sorted(choices)]


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several requests' streams as they come; one stream: no tasks."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(i, stream):
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, done))
        except BaseException as e:  # noqa: BLE001 (handed to the consumer)
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(drain(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


def _usage_counts(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _usage(prompt_lens: list[int], choices: list[_Choice]) -> dict:
    return _usage_counts(sum(prompt_lens), sum(len(c.token_ids) for c in choices))


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    """Server-Sent Events: one `data: {json}` event per chunk, then `data: [DONE]`. An engine error
    mid-stream is sent as an error event (the status line has gone out already)."""

    async def events():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except (ValueError, TypeError, RuntimeError) as e:
            yield f"data: {json.dumps(OpenAIError(str(e), 500, 'InternalServerError').body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


# ---- the app -----------------------------------------------------------------------------------------
async def _wait_for_disconnect(raw_request: Request):
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(raw_request: Request, handler: Awaitable):
    """Await a route's handler, unless its client hangs up first: then the handler is cancelled, which
    aborts the engine requests it was waiting for. (A streamed answer is returned at once; its own
    stream ends when the client goes.) Needs the request's body read already.
    vLLM: vllm/entrypoints/utils.py (with_cancellation)."""
    handler_task = asyncio.ensure_future(handler)
    disconnect_task = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait((handler_task, disconnect_task), return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect_task.cancel()
        if not handler_task.done():
            handler_task.cancel()
            await asyncio.wait((handler_task,))  # its requests are aborted when it returns
    if handler_task.cancelled():
        return Response(status_code=499)  # nginx's "client closed request": nobody is there to read it
    return handler_task.result()


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 413: "RequestTooLargeError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}


def _add_error_handlers(app: FastAPI):
    """Every error is answered in the OpenAI shape, with a message that says what to change."""
    routes = ", ".join(f"{method} {route.path}" for route in app.routes if isinstance(route, APIRoute)
                       for method in sorted(route.methods))

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message = f"There is no route {where}. This server answers {routes}."
        elif exc.status_code == 405:
            message = f"{request.url.path} answers {exc.headers['Allow']}, not {request.method}."
        else:
            message = f"{where}: {exc.detail}"
        err_type = _ERROR_TYPES.get(exc.status_code, "BadRequestError")
        return OpenAIError(message, exc.status_code, err_type, headers=exc.headers).response()

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect):
        return Response(status_code=499)  # it hung up while sending its body: nobody is there to read it

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError):
        return OpenAIError(str(exc), 503, "ServiceUnavailableError").response()

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError):
        return OpenAIError(str(exc)).response()

    @app.exception_handler(TypeError)
    async def _type_error(request: Request, exc: TypeError):
        return OpenAIError(str(exc)).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):  # the traceback goes to the server's log
        return OpenAIError(f"Internal server error ({type(exc).__name__}); the server's log has the details.",
                           500, "InternalServerError").response()


def build_app(async_llm: AsyncLLM, served_model_name: str, api_key: str | None = None,
              stat_logger: PrometheusStatLogger | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The FastAPI app serving one model; the engine is shut down when the app stops.
    `stat_logger` must be among async_llm's stat loggers."""
    serving = OpenAIServing(async_llm, served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        serving.shutdown()
        async_llm.shutdown()  # in-flight requests aborted, device memory released
        logger.info("engine shut down")

    app = FastAPI(title="minivllm OpenAI-compatible server", lifespan=lifespan)
    app.state.serving = serving
    app.add_middleware(RequestSizeLimitMiddleware, max_request_bytes=max_request_bytes)

    async def check_api_key(request: Request):
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise OpenAIError("Unauthorized: a valid API key is needed (Authorization: Bearer ...).", 401,
                              "AuthenticationError")

    v1 = [Depends(check_api_key)]

    @app.post("/v1/completions", dependencies=v1)
    async def create_completion(raw_request: Request):
        body = await serving.parse(raw_request, CompletionRequest)
        return await until_disconnected(raw_request, serving.completions(body))

    @app.post("/v1/chat/completions", dependencies=v1)
    async def create_chat_completion(raw_request: Request):
        body = await serving.parse(raw_request, ChatCompletionRequest)
        return await until_disconnected(raw_request, serving.chat(body))

    @app.get("/v1/models", dependencies=v1)
    async def list_models():
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": int(time.time()), "owned_by": "minivllm",
            "root": async_llm.config.model, "max_model_len": serving.max_model_len,
            "vocab_size": async_llm.config.hf_config.vocab_size}]}  # (extensions: a token-id client needs them)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if async_llm.is_running else 503)

    @app.get("/metrics")
    async def metrics():
        if stat_logger is None:
            raise OpenAIError("metrics are off", 404, "NotFoundError")
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(stat_logger.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/step_trace")
    async def step_trace():
        """The engine's step records since the last call (`--step-trace`), for finding stalls."""
        records = await asyncio.wait_for(async_llm.take_step_trace(), timeout=60)
        if records is None:
            raise OpenAIError("the step trace is off (start the server with --step-trace)", 404, "NotFoundError")
        return {"steps": records}

    _add_error_handlers(app)
    return app


# ---- command line --------------------------------------------------------------------------------------
def make_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minivllm serve", description="OpenAI-compatible server for one model.")
    add_model_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start-up)")
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                   help="clients must send 'Authorization: Bearer KEY' (default: $VLLM_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies are answered 413 before they are read (default: %(default)s)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine loop in a process of its own (default), not in a thread of the server")
    p.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True,
                   help="on CUDA, run short requests through the engine before serving (nothing compiles "
                   "inside the first clients' requests)")
    p.add_argument("--step-trace", action="store_true",
                   help="record every engine step (kind, batch, host and device ms) for GET /debug/step_trace")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    add_engine_args(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = make_arg_parser()
    return resolve_model(parser, parser.parse_args(argv))


# A server on a GPU seats this many sequences unless told (vLLM's OpenAI server default on cards of
# 70 GiB and more): a burst of requests is prefilled as it arrives instead of waiting for seats.
SERVING_MAX_NUM_SEQS_GPU = 1024


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine options the command line set (the rest keep Config's defaults, but for two on a GPU:
    whole-prompt prefill, `serving_chunked_prefill`, and SERVING_MAX_NUM_SEQS_GPU seats)."""
    kwargs = engine_kwargs_from_args(args)
    if "enable_chunked_prefill" not in kwargs and not serving_chunked_prefill(kwargs):
        kwargs["enable_chunked_prefill"] = False
    if "max_num_seqs" not in kwargs and _on_gpu(kwargs):
        kwargs["max_num_seqs"] = SERVING_MAX_NUM_SEQS_GPU
    return kwargs


def _on_gpu(kwargs: dict) -> bool:
    import torch

    device = kwargs.get("device", "auto")
    return str(device).startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def serving_chunked_prefill(kwargs: dict) -> bool:
    """Whether the server chunks prompts when --[no-]enable-chunked-prefill is not given: not on a GPU,
    where a whole prompt in its own step gives lower latencies today (benchmarks/README.md, serving:
    on the H200 at 32 req/s TTFT p99 21 ms and TPOT 2.05 ms with whole prompts, 49 and 3.07 ms with
    chunks, whose mixed steps cost 10-19 ms against 1.7 for a decode step and 4.6 for a short prompt).
    Offline (`LLM`) the engine's default stays on: there it is faster. A budget smaller than a prompt
    can be needs chunking anyway (max_model_len unset resolves to at most 4096)."""
    from minivllm.config import Config

    budget = kwargs.get("max_num_batched_tokens", Config.max_num_batched_tokens)
    return not _on_gpu(kwargs) or budget < (kwargs.get("max_model_len") or 4096)


class _Server(uvicorn.Server):
    """uvicorn, plus: print the bound address (--port 0), and on SIGTERM/Ctrl-C stop the engine first,
    so that in-flight streams end at once instead of holding the graceful shutdown open."""

    def __init__(self, config: uvicorn.Config, async_llm: AsyncLLM):
        super().__init__(config)
        self.async_llm = async_llm

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(f"minivllm: serving on http://{host}:{port}", flush=True)

    def handle_exit(self, sig, frame):
        self.async_llm.stop()
        super().handle_exit(sig, frame)


def _show_logs():
    """minivllm's INFO lines on stderr, unless logging was set up already (the engine's own lines
    come from its process, which sets up the same)."""
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("minivllm %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def run_server(args: argparse.Namespace) -> None:
    _show_logs()
    # With the engine loop in a thread (--no-engine-process) it shares the GIL with the event loop; a
    # thread that wants it waits up to the switch interval (5 ms by default) for the other to let go:
    # longer than a decode step.
    sys.setswitchinterval(0.001)
    served_model_name = args.served_model_name or args.model
    stat_logger = PrometheusStatLogger(served_model_name)
    options = CoreOptions(warm_up=args.warm_up, step_trace=args.step_trace)
    async_llm = AsyncLLM(args.model, stat_loggers=[stat_logger], engine_process=args.engine_process,
                         core_options=options, **engine_kwargs(args))
    try:
        stat_logger.attach(async_llm)
        app = build_app(async_llm, served_model_name, args.api_key, stat_logger, args.max_request_bytes)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                timeout_graceful_shutdown=10, access_log=False)
        # The server's objects from start-up live until the end: keep them out of full collections.
        gc.collect()
        gc.freeze()
        _Server(config, async_llm).run()
    finally:
        async_llm.shutdown()  # when the app never started
        gc.unfreeze()


def main(argv: list[str] | None = None) -> None:
    run_server(parse_args(argv))


if __name__ == "__main__":
    main()
