"""A bound on request bodies: a body larger than --max-request-bytes is answered 413, in the OpenAI
error shape, before any of it is parsed. An ASGI middleware, so that it sees the body as it arrives:
it refuses at once when Content-Length is too large, and counts the bytes of a body sent without one.
vLLM sets no body limit; its pure-ASGI middlewares have this shape (AuthenticationMiddleware in
vllm/entrypoints/openai/server_utils.py, api_server.py in older releases).
"""
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minivllm.entrypoints.openai.protocol import OpenAIError

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # 4 MiB: a 128k-token prompt as token ids is under 1 MiB of JSON


def request_too_large(max_request_bytes: int, content_length: int | None = None) -> OpenAIError:
    size = f" ({content_length} bytes)" if content_length is not None else ""
    return OpenAIError(f"The request body{size} is larger than this server accepts ({max_request_bytes} bytes, "
                       "--max-request-bytes). Send a shorter prompt, or fewer prompts per request.",
                       413, "RequestTooLargeError")


class RequestSizeLimitMiddleware:
    """Answers 413 to an HTTP request whose body is larger than `max_request_bytes`."""

    def __init__(self, app: ASGIApp, max_request_bytes: int):
        self.app = app
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        content_length = dict(scope["headers"]).get(b"content-length")
        if content_length is not None and int(content_length) > self.max_request_bytes:
            await request_too_large(self.max_request_bytes, int(content_length)).response()(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive: Receive) -> Receive:
        """`receive`, raising 413 once the body read so far passes the limit (the app's OpenAIError
        handler answers it)."""
        num_bytes = 0

        async def counting_receive() -> Message:
            nonlocal num_bytes
            message = await receive()
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > self.max_request_bytes:
                    raise request_too_large(self.max_request_bytes)
            return message

        return counting_receive
