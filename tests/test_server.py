"""The OpenAI-compatible server end to end: a real `minivllm serve` process on 127.0.0.1 (a free port)
with a tiny random model, driven by the official openai client (sync and async) and raw HTTP.

Every wait is bounded (client timeouts, deadlines on polls); the server is always stopped."""
import asyncio
import http.client
import json
import re
import threading
import time
import urllib.parse

import pytest

openai = pytest.importorskip("openai", reason="the openai client is not installed (pip install -e '.[dev]')")
pytest.importorskip("fastapi", reason="fastapi is not installed (pip install -e '.[serve]')")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from minivllm.entrypoints.openai.server_process import ServerProcess  # noqa: E402
from server_helpers import wait_for  # noqa: E402

API_KEY = "test-key"
MODEL = "tiny"
MAX_MODEL_LEN = 256
NUM_BLOCKS = 1024
TIMEOUT = 60.0
SERVER_ARGS = ["--served-model-name", MODEL, "--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-batched-tokens", "1024", "--max-num-seqs", "64", "--num-gpu-blocks-override",
               str(NUM_BLOCKS), "--device", "cpu", "--dtype", "float32", "--step-trace"]


@pytest.fixture(scope="module")
def server(qwen3_tiny_dir):
    with ServerProcess(qwen3_tiny_dir, SERVER_ARGS, env={"OMP_NUM_THREADS": "1"}, startup_timeout=180) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=TIMEOUT, max_retries=0)


def async_client(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=TIMEOUT, max_retries=0)


def connect(server) -> http.client.HTTPConnection:
    address = urllib.parse.urlsplit(server.url)
    return http.client.HTTPConnection(address.hostname, address.port, timeout=TIMEOUT)


def request(server, method, path, body=None, headers=None) -> tuple[int, bytes]:
    """Raw HTTP (for what the openai client will not send): status and body. `body`: a dict (sent as
    JSON) or bytes (sent as they are)."""
    conn = connect(server)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


AUTH = {"Authorization": f"Bearer {API_KEY}"}


def metrics(server) -> dict[str, float]:
    """Every sample of /metrics as {name{labels}: value}, parsed by prometheus_client's own parser."""
    status, text = request(server, "GET", "/metrics")
    assert status == 200
    text = text.decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def wait_idle(server):
    wait_for(lambda: metrics(server)["vllm:num_requests_running"] == 0
             and metrics(server)["vllm:num_requests_waiting"] == 0, TIMEOUT, "an idle engine")


GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


def test_health_models_and_auth(server, client):
    assert request(server, "GET", "/health")[0] == 200
    (model,) = client.models.list().data
    assert model.id == MODEL and model.model_extra["vocab_size"] == 8064 and model.model_extra["max_model_len"] > 0
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status, body = request(server, "POST", "/v1/completions", {"prompt": "hi"}, headers)
        assert status == 401 and json.loads(body)["error"]["code"] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_completion_streamed_equals_non_streamed_and_usage(client):
    prompt = "The quick brown fox"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens > 0 and full.usage.total_tokens == full.usage.prompt_tokens + 12
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_completion_prompt_forms(client):
    """A prompt as a string, token ids, a list of strings, a list of token-id lists: one choice each."""
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4, **GREEDY)
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 4
    many = client.completions.create(model=MODEL, prompt=[[5, 6, 7, 8], [9, 10]], max_tokens=3, **GREEDY)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3,
                                                             **GREEDY).choices[0].text
    assert many.usage.prompt_tokens == 6 and many.usage.completion_tokens == 6
    texts = client.completions.create(model=MODEL, prompt=["one", "two", "three"], max_tokens=2, **GREEDY)
    assert sorted(c.index for c in texts.choices) == [0, 1, 2] and texts.usage.completion_tokens == 6


def test_chat_async_streamed_equals_non_streamed(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]

    async def run():
        async with async_client(server) as c:
            full = await c.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, **GREEDY)
            stream = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, stream=True,
                                                     stream_options={"include_usage": True}, **GREEDY)
            chunks = [chunk async for chunk in stream]
        return full, chunks

    full, chunks = asyncio.run(run())
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 10
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_stop_strings(client):
    prompt = "Once upon a time"
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **GREEDY).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    expected = text[:text.index(stop)]
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, stop=[stop], **GREEDY).choices[0]
    assert done.text == expected and done.finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, stop=stop, stream=True,
                                            **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_and_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=5, n=2, temperature=1.0, seed=1,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1] and out.usage.completion_tokens == 10
    # streamed, n=2: each choice's chunks add up to what the same seeded request gives unstreamed
    chunks = list(client.completions.create(model=MODEL, prompt="hello", max_tokens=5, n=2, temperature=1.0, seed=1,
                                            stream=True, extra_body={"ignore_eos": True}))
    for choice in out.choices:
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == choice.index) == choice.text

    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=5, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 5 and "".join(lp.tokens) == out.choices[0].text
    for token_logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and all(v <= 0.0 for v in top.values())
        assert token_logprob == pytest.approx(max(top.values()), abs=1e-4)  # greedy: the most likely token
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4) for t in content)
    streamed = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4, logprobs=True, top_logprobs=2, stream=True, **GREEDY))
    tokens = [t.token for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert tokens == [t.token for t in content]


def test_penalties_change_the_output(client):
    base = dict(model=MODEL, prompt="the the the", max_tokens=12, **GREEDY)
    plain = client.completions.create(**base).choices[0]
    penalised = client.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **base).choices[0]
    assert len(set(penalised.text.split())) >= len(set(plain.text.split()))
    assert penalised.text != plain.text


BAD_REQUESTS = [  # (body changes, expected status)
    ({"model": "no-such-model"}, 404),
    ({"max_tokens": -1}, 400),
    ({"max_tokens": MAX_MODEL_LEN}, 400),  # prompt + max_tokens beyond the context
    ({"prompt": [7] * (MAX_MODEL_LEN + 1)}, 400),
    ({"prompt": [10**9]}, 400),  # a token id outside the vocabulary
    ({"prompt": []}, 400),
    ({"temperature": -0.5}, 400),
    ({"top_p": 0.0}, 400),
    ({"stop": [""]}, 400),
    ({"echo": True}, 400),
    ({"logit_bias": {"5": 1.0}}, 400),
    ({"n": 0}, 400),
    ({"logprobs": 21}, 400),
    ({"presence_penalty": 3.0}, 400),
    ({"max_tokens": "many"}, 400),
    ({"prompt": None}, 400),
]


def test_bad_inputs_answered_while_a_stream_continues(server, client):
    result = {}

    def stream():
        chunks = list(client.completions.create(model=MODEL, prompt="a long story", max_tokens=40, stream=True,
                                                stream_options={"include_usage": True}, **GREEDY))
        result["finish"] = chunks[-2].choices[0].finish_reason
        result["num_tokens"] = chunks[-1].usage.completion_tokens

    thread = threading.Thread(target=stream)
    thread.start()
    for change, expected in BAD_REQUESTS:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **change}
        status, text = request(server, "POST", "/v1/completions", body, AUTH)
        assert status == expected, (change, text)
        error = json.loads(text)["error"]
        assert error["code"] == expected and error["message"], change
    status, text = request(server, "POST", "/v1/completions", b'{"model": "tiny", "prompt": ', AUTH)
    assert status == 400 and "error" in json.loads(text)
    status, _ = request(server, "POST", "/v1/chat/completions", {"model": MODEL, "messages": []}, AUTH)
    assert status == 400
    thread.join(TIMEOUT)
    assert not thread.is_alive()
    assert result == {"finish": "length", "num_tokens": 40}
    wait_idle(server)


def test_64_concurrent_streams_all_complete(server):
    """64 clients at once (8 distinct requests, 8 clients each): every stream's text equals the
    non-streamed text of its request, with the requested token count: nothing lost, nothing duplicated
    (a slow reader gets several tokens in one chunk, never a token twice)."""
    num_clients, num_distinct = 64, 8

    def request_of(i):
        return dict(model=MODEL, prompt=f"client {i % num_distinct} says", max_tokens=4 + i % num_distinct % 5,
                    **GREEDY)

    async def streamed(c, i):
        stream = await c.completions.create(stream=True, stream_options={"include_usage": True}, **request_of(i))
        chunks = [chunk async for chunk in stream]
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        return text, [ch for ch in chunks if ch.choices][-1].choices[0].finish_reason, chunks[-1].usage.completion_tokens

    async def run():
        async with async_client(server) as c:
            expected = await asyncio.gather(*[c.completions.create(**request_of(i)) for i in range(num_distinct)])
            results = await asyncio.wait_for(asyncio.gather(*[streamed(c, i) for i in range(num_clients)]),
                                             2 * TIMEOUT)
        return expected, results

    before = metrics(server)["vllm:generation_tokens_total"]
    expected, results = asyncio.run(run())
    for i, (text, finish, num_tokens) in enumerate(results):
        want = expected[i % num_distinct].choices[0]
        assert (text, finish, num_tokens) == (want.text, "length", request_of(i)["max_tokens"]), i
    num_generated = sum(request_of(i)["max_tokens"] for i in range(num_clients + num_distinct))
    assert metrics(server)["vllm:generation_tokens_total"] - before == num_generated
    wait_idle(server)


def test_disconnect_mid_stream_frees_blocks(server):
    wait_idle(server)
    before = metrics(server)
    body = {"model": MODEL, "prompt": "keep going", "max_tokens": 200, "stream": True, "ignore_eos": True}
    conn = connect(server)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", **AUTH})
        r = conn.getresponse()
        assert r.status == 200
        events = 0
        while events < 3:
            line = r.fp.readline().decode()
            assert line, "the stream ended early"
            if line.startswith("data: {"):
                json.loads(line[len("data: "):])
                events += 1
        running = metrics(server)
        assert running["vllm:kv_cache_usage_perc"] > 0
        assert running["vllm:gpu_cache_usage_perc"] == running["vllm:kv_cache_usage_perc"]  # vLLM's older name
    finally:
        conn.sock.shutdown(2) if conn.sock else None
        conn.close()
    # The client hung up: the request is aborted, its blocks are free again.
    wait_for(lambda: metrics(server)["vllm:num_requests_running"] == 0, TIMEOUT, "the aborted request to leave")
    after = metrics(server)
    assert after["vllm:kv_cache_usage_perc"] == 0.0
    assert after["vllm:request_success_total{finished_reason=abort}"] == \
        before["vllm:request_success_total{finished_reason=abort}"] + 1
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 200


def test_metrics_have_vllm_names(server, client):
    client.completions.create(model=MODEL, prompt="count me", max_tokens=3, **GREEDY)
    m = metrics(server)
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_success_total{finished_reason=length}"]:
        assert name in m, name
    assert m["vllm:time_to_first_token_seconds_count"] >= 1 and m["vllm:e2e_request_latency_seconds_count"] >= 1
    assert m["vllm:prefix_cache_hits_total"] <= m["vllm:prefix_cache_queries_total"]
    assert m["vllm:generation_tokens_total"] >= 3 and m["vllm:prompt_tokens_total"] > 0


def test_step_trace_counts_every_computed_token(server, client):
    """GET /debug/step_trace: the engine's steps since the last call; one request of a 10-token
    prompt and 6 tokens computes 10 + 5 tokens (its last token is sampled, never computed)."""
    wait_idle(server)
    assert request(server, "GET", "/debug/step_trace")[0] == 200  # drop the earlier tests' steps
    client.completions.create(model=MODEL, prompt=list(range(101, 111)), max_tokens=6, **GREEDY)
    status, body = request(server, "GET", "/debug/step_trace")
    steps = json.loads(body)["steps"]
    assert status == 200 and sum(s["num_tokens"] for s in steps) == 10 + 6 - 1
    assert steps[0]["kind"] == "prefill" and [s["kind"] for s in steps[1:]] == ["decode"] * 5
    assert all(s["num_seqs"] == 1 and 0 <= s["wall_ms"] <= s["host_ms"] for s in steps)
    assert json.loads(request(server, "GET", "/debug/step_trace")[1])["steps"] == []


def test_server_with_the_engine_loop_in_a_thread(qwen3_tiny_dir):
    """--no-engine-process: the same answers from an engine stepped by a thread of the server."""
    args = ["--max-model-len", "128", "--num-gpu-blocks-override", "64", "--device", "cpu", "--dtype", "float32"]
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    texts = []
    for flag in ("--no-engine-process", "--engine-process"):
        with ServerProcess(qwen3_tiny_dir, args + [flag], env={"OMP_NUM_THREADS": "1"}, startup_timeout=180) as s:
            status, answer = request(s, "POST", "/v1/completions", body)
            assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] == 5
            texts.append(json.loads(answer)["choices"][0]["text"])
            assert request(s, "GET", "/debug/step_trace")[0] == 404  # no --step-trace
            if flag == "--engine-process":  # the start-up log times each phase of the engine's start
                log = s.log_tail(200)
                for phase in (r"engine core process running [\d.]+ s after it was spawned",
                              r"config and tokenizer read in [\d.]+ s", r"engine built in [\d.]+ s",
                              r"sized and allocated in [\d.]+ s", r"engine core ready in [\d.]+ s"):
                    assert re.search(phase, log), (phase, log)
    assert texts[0] == texts[1]


def test_speculative_config_streams_the_same_text(server, client, qwen3_tiny_dir):
    """`--speculative-config` (n-gram): the same greedy text, streamed, as the server without it; the
    drafts show in /metrics."""
    prompt = list(range(5, 21)) * 4  # copy-heavy: every suffix of the prompt occurred earlier in it
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=24, **GREEDY)
    expected = client.completions.create(**kwargs).choices[0].text
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                       "prompt_lookup_max": 4})
    with ServerProcess(qwen3_tiny_dir, SERVER_ARGS + ["--speculative-config", spec], env={"OMP_NUM_THREADS": "1"},
                       startup_timeout=180) as s:
        spec_client = openai.OpenAI(base_url=s.url + "/v1", api_key=API_KEY, timeout=TIMEOUT, max_retries=0)
        chunks = list(spec_client.completions.create(stream=True, **kwargs))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        m = metrics(s)
        assert m["vllm:spec_decode_num_drafts_total"] >= 1, m
        assert m["vllm:spec_decode_num_draft_tokens_total"] >= m["vllm:spec_decode_num_accepted_tokens_total"]


def test_bench_serving_sweep(server, tmp_path):
    """The serving benchmark against a running server: two rates in one run, JSON written.
    (`--launch` starts its server with ServerProcess, the helper every test here uses.)"""
    from benchmarks import bench_serving

    code = bench_serving.main(["--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "6",
                               "--input-len", "24", "--output-len", "5",  # prompt ids below the served vocab_size
                               "--request-rate", "20", "inf", "--max-concurrency", "4", "--out-dir", str(tmp_path)])
    assert code == 0
    payload = json.loads((tmp_path / "bench_serving.json").read_text())
    assert payload["server_startup_seconds"] is None  # not launched by the benchmark
    assert [r["request_rate"] for r in payload["results"]] == [20.0, "inf"]
    traces = json.loads((tmp_path / "bench_serving_steps.json").read_text())  # the server keeps a step trace
    for r, trace in zip(payload["results"], traces):
        assert trace["request_rate"] == r["request_rate"] and r["step_trace"].startswith("step trace:")
        computed_or_cached = sum(s["num_tokens"] + s["num_cached_tokens"] for s in trace["steps"])
        assert computed_or_cached == 6 * 24 + 6 * (5 - 1)
    for r in payload["results"]:
        assert r["completed"] == 6 and r["failed"] == 0
        assert r["total_input_tokens"] == 6 * 24 and r["total_output_tokens"] == 6 * 5
        assert 0 < r["ttft_ms"]["median"] <= r["ttft_ms"]["p99"] <= r["e2el_ms"]["p99"]
        assert r["tpot_ms"]["mean"] > 0 and r["itl_ms"]["p99"] > 0
        assert r["output_throughput"] == pytest.approx(30 / r["duration_s"])


def test_bench_serving_arrivals_and_percentiles():
    from benchmarks.bench_serving import _percentiles, arrival_delays

    delays = arrival_delays(4000, 8.0, seed=0)
    assert delays[0] == 0.0 and all(b >= a for a, b in zip(delays, delays[1:]))
    assert delays[-1] / len(delays) == pytest.approx(1 / 8.0, rel=0.05)  # Poisson: mean gap 1/rate
    assert arrival_delays(5, float("inf"), seed=0) == [0.0] * 5
    p = _percentiles([i / 1000 for i in range(1, 102)])  # 1..101 ms
    assert p["mean"] == pytest.approx(51) and p["median"] == pytest.approx(51) and p["p99"] == pytest.approx(100)


def test_sigterm_stops_the_server_with_a_stream_in_flight(server):
    """The last test that uses the module's server: it stops it. The stream in flight ends, the engine shuts down."""
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=TIMEOUT, max_retries=0)
    stream = c.completions.create(model=MODEL, prompt="forever", max_tokens=MAX_MODEL_LEN - 8, stream=True,
                                  **GREEDY)
    chunks = iter(stream)
    next(chunks)  # it is running
    start = time.monotonic()
    server.proc.terminate()
    with pytest.raises(openai.APIError, match="shut down"):  # the stream ends with an error event, at once
        for _ in chunks:
            pass
    assert time.monotonic() - start < 5  # not held open until uvicorn's graceful timeout (10 s)
    server.proc.wait(TIMEOUT)
    assert "engine shut down" in server.log_tail()


def test_cli_flags_map_to_engine_options(capsys):
    from minivllm.entrypoints.cli import main as cli_main
    from minivllm.entrypoints.openai.api_server import engine_kwargs, make_arg_parser

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["serve", "--help"])
    assert exit_info.value.code == 0 and "--max-num-seqs" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["generate"])
    assert exit_info.value.code == 2
    # --device cpu: the same options on a machine with a GPU, where the server adds enable_chunked_prefill=False
    # unless told (test_server_prefills_whole_prompts_on_a_gpu_unless_told)
    args = make_arg_parser().parse_args(["m", "--max-num-seqs", "8", "--no-enable-prefix-caching", "--block-size", "32",
                                         "--num-gpu-blocks-override", "100", "--gpu-memory-utilization", "0.5",
                                         "--max-prompt-graph-tokens", "1024", "--device", "cpu"])
    assert engine_kwargs(args) == dict(max_num_seqs=8, enable_prefix_caching=False, kvcache_block_size=32,
                                       num_kvcache_blocks=100, gpu_memory_utilization=0.5, max_prompt_graph_tokens=1024,
                                       device="cpu")
    args = make_arg_parser().parse_args(["m", "--device", "cpu", "--mixed-step-attention", "split", "--kv-cache-dtype",
                                         "fp8", "--quantization", "fp8"])
    assert engine_kwargs(args) == dict(device="cpu", mixed_step_attention="split", kv_cache_dtype="fp8",
                                       quantization="fp8")
    for flag, value in (("--small-batch-gemv", True), ("--no-small-batch-gemv", False)):
        assert engine_kwargs(make_arg_parser().parse_args(["m", "--device", "cpu", flag])) == dict(
            device="cpu", small_batch_gemv=value)


def test_model_as_positional_or_option(capsys):
    """`minivllm serve DIR` and vLLM's `--model DIR`: exactly one of them, or both naming the same."""
    from minivllm.entrypoints.openai.api_server import parse_args

    assert parse_args(["m"]).model == parse_args(["--model", "m"]).model == parse_args(["m", "--model", "m"]).model == "m"
    for argv, message in (([], "the model directory is missing: give it as MODEL or --model MODEL"),
                          (["a", "--model", "b"], "two models given ('a' and --model 'b'): give one")):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_bench_serving_offline_reference(qwen3_tiny_dir):
    from benchmarks import bench_serving

    args = bench_serving.make_parser().parse_args(["--launch", qwen3_tiny_dir])
    requests = bench_serving.random_requests(3, 16, 4, 0.0, 8000, seed=0)
    result = bench_serving.offline_reference(qwen3_tiny_dir, "--max-model-len 128 --num-gpu-blocks-override 64 "
                                             "--device cpu --max-num-seqs 4", requests, args)
    assert result["total_output_tokens"] == 12 and result["output_throughput"] > 0
    assert result["engine_options"] == dict(max_model_len=128, num_kvcache_blocks=64, device="cpu", max_num_seqs=4)
    with pytest.raises(SystemExit):  # needs --launch
        bench_serving.main(["--offline-reference"])
def test_server_prefills_whole_prompts_on_a_gpu_unless_told(monkeypatch):
    """On a GPU the server turns chunked prefill off unless a flag says otherwise or the token budget is
    smaller than a prompt can be; on the CPU (and offline, in `LLM`) the engine's default, on, stays."""
    import torch

    from minivllm.entrypoints.openai.api_server import engine_kwargs, make_arg_parser

    def kwargs(*flags):
        return engine_kwargs(make_arg_parser().parse_args(["m", *flags]))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "enable_chunked_prefill" not in kwargs()
    assert kwargs("--device", "cuda")["enable_chunked_prefill"] is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert kwargs()["enable_chunked_prefill"] is False
    assert "enable_chunked_prefill" not in kwargs("--device", "cpu")
    assert kwargs("--enable-chunked-prefill")["enable_chunked_prefill"] is True
    assert "enable_chunked_prefill" not in kwargs("--max-num-batched-tokens", "2048")  # below 4096: chunks needed
    assert "enable_chunked_prefill" not in kwargs("--max-model-len", "32768")
    assert kwargs("--max-model-len", "2048", "--max-num-batched-tokens", "2048")["enable_chunked_prefill"] is False


def test_server_seats_1024_sequences_on_a_gpu_unless_told(monkeypatch):
    """vLLM's OpenAI-server default on a large GPU: a burst of 400 requests is admitted at once instead
    of waiting for 256 seats (its TTFT tail at saturation); the CPU keeps the engine's 256."""
    import torch

    from minivllm.entrypoints.openai.api_server import SERVING_MAX_NUM_SEQS_GPU, engine_kwargs, make_arg_parser

    def kwargs(*flags):
        return engine_kwargs(make_arg_parser().parse_args(["m", *flags]))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert kwargs()["max_num_seqs"] == SERVING_MAX_NUM_SEQS_GPU == 1024
    assert kwargs("--max-num-seqs", "64")["max_num_seqs"] == 64
    assert "max_num_seqs" not in kwargs("--device", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "max_num_seqs" not in kwargs()
