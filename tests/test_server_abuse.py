"""The server against clients that misbehave: they hang up on a non-streamed answer, send bodies too
large to read or not UTF-8, lone surrogates, routes and methods that do not exist, and prompts that
take seconds to tokenize while others stream. A real `minivllm serve` process (tiny random model,
started with the `--model DIR` spelling), raw HTTP; every wait is bounded, the server always stopped."""
import http.client
import json
import socket
import threading
import time
import urllib.parse

import pytest

pytest.importorskip("fastapi", reason="fastapi is not installed (pip install -e '.[serve]')")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from minivllm.entrypoints.openai.request_limits import DEFAULT_MAX_REQUEST_BYTES  # noqa: E402
from minivllm.entrypoints.openai.server_process import ServerProcess  # noqa: E402
from server_helpers import wait_for  # noqa: E402

MAX_MODEL_LEN = 4096  # the tiny model's max_position_embeddings: the longest text the early bound lets through
TIMEOUT = 60.0
SERVER_ARGS = ["--served-model-name", "tiny", "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override",
               "1024", "--device", "cpu", "--dtype", "float32"]


@pytest.fixture(scope="module")
def server(qwen3_tiny_dir):
    # `--model=DIR` in the model's place: the server is started with vLLM's spelling of the flag.
    with ServerProcess(f"--model={qwen3_tiny_dir}", SERVER_ARGS, env={"OMP_NUM_THREADS": "1"},
                       startup_timeout=180) as s:
        yield s


def connect(server, timeout=TIMEOUT) -> http.client.HTTPConnection:
    address = urllib.parse.urlsplit(server.url)
    return http.client.HTTPConnection(address.hostname, address.port, timeout=timeout)


def request(server, method, path, body: bytes | None = None) -> tuple[int, dict | None]:
    conn = connect(server)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        return r.status, json.loads(data) if data else None
    finally:
        conn.close()


def openai_error(status: int, body: dict) -> dict:
    """The error of an OpenAI-shaped error body, checked: {"error": {message, type, param, code}}."""
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == status and body["error"]["message"], body
    return body["error"]


def metrics(server) -> dict[str, float]:
    conn = connect(server)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            reason = s.labels.get("finished_reason")
            samples[f"{s.name}{{{reason}}}" if reason else s.name] = s.value
    return samples


def test_disconnected_non_streamed_requests_are_aborted(server):
    """Two clients that will not wait for their answers (3 engine requests: a completion of two prompts
    and a chat), each far from done when they hang up: within a second none runs and the KV cache is
    empty; they count as aborted, not as finished by length."""
    wait_for(lambda: metrics(server)["vllm:num_requests_running"] == 0, TIMEOUT, "an idle engine")
    before = metrics(server)
    bodies = {"/v1/completions": {"prompt": ["a", "b"], "max_tokens": 3000, "ignore_eos": True},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000,
                                       "ignore_eos": True}}
    conns = []
    try:
        for path, body in bodies.items():
            conns.append(connect(server))
            conns[-1].request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        wait_for(lambda: metrics(server)["vllm:num_requests_running"] == 3, TIMEOUT, "the 3 requests to run")
        running = metrics(server)
        assert running["vllm:kv_cache_usage_perc"] > 0
        assert running["vllm:gpu_cache_usage_perc"] == running["vllm:kv_cache_usage_perc"]  # vLLM's older name
    finally:
        for conn in conns:
            conn.close()
    wait_for(lambda: metrics(server)["vllm:num_requests_running"] == 0, 1.0, "the requests to be aborted")
    after = metrics(server)
    assert after["vllm:kv_cache_usage_perc"] == 0.0 and after["vllm:gpu_cache_usage_perc"] == 0.0
    assert after["vllm:request_success_total{abort}"] - before["vllm:request_success_total{abort}"] == 3
    assert after["vllm:request_success_total{length}"] == before["vllm:request_success_total{length}"]


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    # Content-Length says 5 MB and no byte of the body is sent: a server that read it would wait.
    conn = connect(server, timeout=10)
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", "5000000")
        conn.endheaders()
        r = conn.getresponse()
        error = openai_error(413, json.loads(r.read()))
    finally:
        conn.close()
    assert r.status == 413 and error["type"] == "RequestTooLargeError"
    assert error["message"].startswith(f"The request body (5000000 bytes) is larger than this server accepts "
                                       f"({DEFAULT_MAX_REQUEST_BYTES} bytes, --max-request-bytes)")
    # the case: a 5 MB prompt, sent whole
    status, body = request(server, "POST", "/v1/completions", json.dumps({"prompt": "x" * 5_000_000}).encode())
    assert status == 413 and openai_error(413, body)["type"] == "RequestTooLargeError"
    # a body sent in chunks, without Content-Length: counted as it arrives
    conn = connect(server)
    try:
        chunks = (b" " * 100_000 for _ in range(DEFAULT_MAX_REQUEST_BYTES // 100_000 + 1))
        conn.request("POST", "/v1/completions", body=chunks, headers={"Content-Type": "application/json"},
                     encode_chunked=True)
        r = conn.getresponse()
        error = openai_error(413, json.loads(r.read()))
    finally:
        conn.close()
    assert r.status == 413 and error["message"].startswith("The request body is larger than this server accepts")
    assert request(server, "GET", "/health")[0] == 200


def test_a_client_that_hangs_up_mid_body_leaves_no_traceback(server):
    address = urllib.parse.urlsplit(server.url)
    with socket.create_connection((address.hostname, address.port), timeout=TIMEOUT) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
    time.sleep(0.5)  # (the server sees the connection close at once; a traceback would be logged by now)
    assert request(server, "GET", "/health")[0] == 200 and "Traceback" not in server.log_tail(200)


LONE_SURROGATE_MESSAGE = ("holds a lone surrogate ('\\ud800' at character 1), which is not text: a character above "
                          "U+FFFF is sent as a pair of surrogates (\\ud83d\\ude00), never one alone.")
ERROR_CASES = [  # (method, path, body, status, type, param, message)
    ("POST", "/v1/completions", b'{"prompt": "caf\xe9"}', 400, "BadRequestError", None,
     "The request body is not valid UTF-8 (byte 0xe9 at offset 15): send the JSON encoded as UTF-8."),
    ("POST", "/v1/completions", b'{"prompt": "hi",', 400, "BadRequestError", None,
     "The request body is not valid JSON: Expecting property name enclosed in double quotes (line 1, column 17)."),
    ("POST", "/v1/completions", b'["hi"]', 400, "BadRequestError", None,
     "The request body must be a JSON object ({...}), not a JSON list."),
    ("POST", "/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "BadRequestError", "prompt",
     "prompt " + LONE_SURROGATE_MESSAGE),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400,
     "BadRequestError", "messages[0].content", "messages[0].content " + LONE_SURROGATE_MESSAGE),
    ("POST", "/v1/completions", b'{"model": "a\\ud800", "prompt": "hi"}', 404, "NotFoundError", "model",
     "The model `a\\ud800` does not exist."),
    ("GET", "/v1/nothing", None, 404, "NotFoundError", None,
     "There is no route GET /v1/nothing. This server answers POST /v1/completions, POST /v1/chat/completions, "
     "GET /v1/models, GET /health, GET /metrics, GET /debug/step_trace."),
    ("GET", "/v1/chat/completions", None, 405, "MethodNotAllowedError", None,
     "/v1/chat/completions answers POST, not GET."),
]


@pytest.mark.parametrize("method,path,body,status,err_type,param,message", ERROR_CASES,
                         ids=["not-utf8", "bad-json", "not-an-object", "surrogate-prompt", "surrogate-message",
                              "surrogate-model", "no-route", "wrong-method"])
def test_errors_in_the_openai_shape(server, method, path, body, status, err_type, param, message):
    got_status, got = request(server, method, path, body)
    assert got_status == status
    assert openai_error(status, got) == {"message": message, "type": err_type, "param": param, "code": status}


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(server):
    """3.6 MB of text: more tokens than the context holds, whatever the tokenizer does (the bound from
    its longest token), so it is refused at once; tokenizing it would take seconds here."""
    text = "hello world " * 300_000
    start = time.perf_counter()
    status, body = request(server, "POST", "/v1/completions", json.dumps({"prompt": text}).encode())
    seconds = time.perf_counter() - start
    error = openai_error(400, body)
    assert error["param"] == "prompt" and error["message"].startswith("The prompt is 3600000 bytes of text, so at "
                                                                      "least ")
    assert error["message"].endswith(f"tokens, more than this model's maximum context length of {MAX_MODEL_LEN} "
                                     "tokens. Please shorten it.")
    assert seconds < 1.0, seconds


def test_max_bytes_per_token_bounds_real_tokenizations(qwen3_tiny_dir, smollm2_dir):
    """The bound's arithmetic on the two tokenizers the tests have: SmolLM2's byte-level vocabulary
    (longest token "\n" + 81 spaces, stored as 162 bytes; no normalizer) and the tiny model's (96 bytes,
    NFC: times 4); and texts that pack the most bytes into a token, or that NFC shrinks, still tokenize
    to at least bytes / bound tokens."""
    from transformers import AutoTokenizer

    from minivllm.entrypoints.openai.api_server import max_bytes_per_token

    for model_dir, expected in ((smollm2_dir, 162), (qwen3_tiny_dir, 96 * 4)):
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        bound = max_bytes_per_token(tokenizer)
        assert bound == expected
        longest = max(tokenizer.get_vocab(), key=lambda token: len(token.encode("utf-8")))
        texts = [tokenizer.decode(tokenizer.convert_tokens_to_ids([longest]) * 50),
                 "\u1100\u1161\u11a8" * 500,  # Hangul jamo: NFC makes 9 bytes 3
                 "hello world, " * 500]
        for text in texts:
            num_tokens = len(tokenizer.encode(text, add_special_tokens=False))
            assert num_tokens * bound >= len(text.encode("utf-8")), (model_dir, text[:20], num_tokens)


def test_tokenizing_long_prompts_does_not_stall_other_clients(server):
    """Three 1.5 MB prompts (under the early bound, so each is tokenized: ~0.8 s each on an idle 2-core
    CPU, one after the other) while a stream runs and /health is polled. With the tokenizing on the
    event loop both stalled for the whole time a prompt tokenized (1.4-1.5 s each time). In its own
    thread, the worst /health answer and the worst gap between two chunks measured 24-55 and 35-83 ms
    with this test alone, up to 106 and 111 ms with another pytest worker on the two cores, 257 and
    266 ms with the machine at load 8 (tokenizing then took 5.6 s a prompt). So the test asks for
    less than a quarter of one prompt's tokenizing time, which a stalled loop cannot meet, and prints
    what it saw."""
    body = json.dumps({"prompt": ("hello world, " * 120_000)[:1_500_000], "max_tokens": 2}).encode()
    stop, chunk_times, health_latencies, answers = threading.Event(), [], [], []

    def stream():
        conn = connect(server)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "go", "max_tokens": MAX_MODEL_LEN - 8,
                                                                 "stream": True, "ignore_eos": True}).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        while not stop.is_set() and (line := r.fp.readline()):
            if line.startswith(b"data: {"):
                chunk_times.append(time.perf_counter())
        conn.close()

    def poll_health():
        conn = connect(server)
        while not stop.is_set():
            start = time.perf_counter()
            conn.request("GET", "/health")
            assert conn.getresponse().read() == b""
            health_latencies.append((start, time.perf_counter() - start))
            time.sleep(0.01)
        conn.close()

    def long_prompt():
        answers.append(request(server, "POST", "/v1/completions", body))

    background = [threading.Thread(target=stream), threading.Thread(target=poll_health)]
    for thread in background:
        thread.start()
    try:
        wait_for(lambda: len(chunk_times) >= 10, TIMEOUT, "the stream to start")
        senders = [threading.Thread(target=long_prompt) for _ in range(3)]
        start = time.perf_counter()
        for thread in senders:
            thread.start()
        for thread in senders:
            thread.join(TIMEOUT)
        end = time.perf_counter()
    finally:
        stop.set()
        for thread in background:
            thread.join(TIMEOUT)
    for status, answer in answers:  # each was tokenized in full, then found too long
        assert status == 400 and "tokens, more than max_model_len=4096" in openai_error(400, answer)["message"]
    assert len(answers) == 3
    in_window = [t for t in chunk_times if start <= t <= end]
    around = chunk_times[chunk_times.index(in_window[0]) - 1:chunk_times.index(in_window[-1]) + 2]
    worst_gap = max(b - a for a, b in zip(around, around[1:]))
    worst_health = max(seconds for t, seconds in health_latencies if start <= t <= end)
    report = (f"{end - start:.2f} s of tokenizing: worst /health {1000 * worst_health:.1f} ms, worst stream gap "
              f"{1000 * worst_gap:.1f} ms ({len(in_window)} chunks)")
    print(report)
    assert end - start > 1.0, report  # the prompts were long enough to stall, had they run on the event loop
    limit = (end - start) / len(answers) / 4
    assert worst_health < limit and worst_gap < limit, report


def test_small_work_stays_on_the_event_loop_and_large_work_leaves_it():
    """A small body or text is handled on the loop (a hop to the preprocessing thread costs more than the
    work, and a burst would queue behind one thread); above the limit the work runs in that thread."""
    import asyncio

    from minivllm.entrypoints.openai import api_server
    from minivllm.entrypoints.openai.api_server import OpenAIServing

    serving = OpenAIServing.__new__(OpenAIServing)  # preprocess needs only the executor
    serving._executor = api_server.ThreadPoolExecutor(max_workers=1)

    async def threads_used():
        small = await serving.preprocess(api_server.INLINE_TEXT_BYTES, api_server.INLINE_TEXT_BYTES,
                                         threading.current_thread)
        large = await serving.preprocess(api_server.INLINE_TEXT_BYTES + 1, api_server.INLINE_TEXT_BYTES,
                                         threading.current_thread)
        return small, large

    try:
        small, large = asyncio.run(threads_used())
    finally:
        serving.shutdown()
    assert small is threading.main_thread()
    assert large is not threading.main_thread()
