"""leanlm serve as clients see it: a real uvicorn on 127.0.0.1, the official openai client and raw HTTP."""

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from serving import KEY, NAME, Server, client, greedy, openai

from leanlm.bench.serve import free_port, leanlm_command


def test_openai_client_completions_chat_streaming(either_server, tiny):
    server, (model, tok) = either_server, tiny
    c = client(server)
    assert [m.id for m in c.models.list().data] == [NAME]
    r = c.completions.create(model=NAME, prompt="hello world", max_tokens=6, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == tok.decode(greedy(model, tok, "hello world", 6))
    assert r.usage.prompt_tokens == len(tok.encode("hello world")) and r.usage.completion_tokens == 6
    two = c.completions.create(model=NAME, prompt="the quick", max_tokens=5, n=2, temperature=1.0, seed=3,
                               logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in two.choices) == [0, 1] and two.usage.completion_tokens == 10
    # the legacy layout keys alternatives by their text: ids without text (this tiny vocabulary's last ones) collide
    assert all(len(ch.logprobs.token_logprobs) == 5 and all(1 <= len(t) <= 2 for t in ch.logprobs.top_logprobs)
               for ch in two.choices)
    full = r.choices[0].text
    cut = c.completions.create(model=NAME, prompt="hello world", max_tokens=6, temperature=0, stop=[full[2:4]],
                               extra_body={"ignore_eos": True})
    assert cut.choices[0].text == full[: full.index(full[2:4])] and cut.choices[0].finish_reason == "stop"
    chat = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                     temperature=0, logprobs=True, top_logprobs=3)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 3
    pieces, usage = [], None
    for chunk in c.completions.create(model=NAME, prompt="hello world", max_tokens=6, temperature=0, stream=True,
                                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        pieces += [ch.text for ch in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) == full and usage.completion_tokens == 6
    deltas = [ch.delta.content or "" for chunk in c.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, stream=True)
        for ch in chunk.choices]
    assert "".join(deltas) == chat.choices[0].message.content


def test_64_concurrent_streams_each_get_their_own_continuation(either_server, tiny):
    server, (model, tok) = either_server, tiny
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]
    prompts = [f"{words[i % 8]} {words[(i // 8) % 8]} {i}" for i in range(64)]
    expected = [tok.decode(greedy(model, tok, p, 8)) for p in prompts]

    async def one(c, p):
        text = ""
        stream = await c.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
        async for chunk in stream:
            text += "".join(ch.text for ch in chunk.choices)
        return text

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    assert asyncio.run(main()) == expected
    assert server.settled()


def test_disconnects_free_every_block(either_server):
    """500 requests, half of them dropped mid-stream or before their first token (streaming and not)."""
    server = either_server
    body = {"model": NAME, "prompt": "hello there world", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}

    async def one(http, i):
        kind = i % 4
        if kind == 3:  # completes normally
            r = await http.post("/v1/completions", json={**body, "max_tokens": 3}, headers=headers)
            return r.status_code
        if kind == 2:  # non-streaming, client gives up before the answer
            try:
                await http.post("/v1/completions", json=body, headers=headers, timeout=0.05)
            except httpx.TimeoutException:
                return "dropped"
            return "finished"
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=headers) as r:
            if kind == 1:  # reads one event, then leaves
                async for _ in r.aiter_lines():
                    break
            return "dropped"  # kind 0: leaves before the first token

    async def main():
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=30) as http:
            return await asyncio.gather(*(one(http, i) for i in range(500)))

    results = asyncio.run(main())
    assert results.count(200) == 125
    assert server.settled(timeout=30)
    assert client(server).completions.create(model=NAME, prompt="hi", max_tokens=2).choices[0].text is not None


def test_a_stream_whose_client_left_before_the_response_began_is_cleaned_up(server):
    """The app called as ASGI with a send that fails at once (ASGI 2.4: Starlette then never starts the body)."""
    body = json.dumps({"model": NAME, "prompt": "hello", "max_tokens": 500, "ignore_eos": True, "stream": True})
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", server.port),
             "headers": [(b"content-type", b"application/json"), (b"authorization", f"Bearer {KEY}".encode())]}

    async def main():
        messages = [{"type": "http.request", "body": body.encode(), "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.sleep(60)  # the client says nothing more

        async def send(message):
            if message["type"] == "http.response.start":
                raise OSError("connection reset")

        with pytest.raises(Exception):
            await server.app(scope, receive, send)

    asyncio.run(main())
    assert server.app.state.active == 0
    assert server.settled(timeout=30)


@pytest.mark.parametrize("payload,status,words", [
    (b"{not json", 400, "JSON"),
    ({"model": "gpt-9", "prompt": "hi"}, 404, "gpt-9"),
    ({"model": NAME}, 400, "prompt"),
    ({"model": NAME, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "temperature": -2}, 400, "temperature"),
    ({"model": NAME, "prompt": "hi", "top_p": 3}, 400, "top_p"),
    ({"model": NAME, "prompt": "hello " * 600}, 400, "context window"),
    ({"model": NAME, "prompt": [5, 6, 100000]}, 400, "token id"),
    ({"model": NAME, "prompt": "x" * (11 << 20)}, 413, "MiB"),
    ({"model": NAME, "prompt": "hi", "leanlm": {"compress_prompt": {"rate": 2}}}, 400, "rate"),
    ({"model": NAME, "prompt": "hi", "leanlm": {"compress_prompt": {"ratio": 0.5}}}, 400, "ratio"),
    ({"model": NAME, "prompt": [5, 6], "leanlm": {"compress_prompt": {}}}, 400, "text prompts"),
])
def test_bad_input_gets_an_openai_error(server, payload, status, words):
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    r = httpx.post(server.url + "/v1/completions", content=data, timeout=30,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == status
    error = r.json()["error"]
    assert words in error["message"] and error["code"] == status
    assert httpx.get(server.url + "/health").status_code == 200


def test_compress_prompt_field_cuts_the_prompt_and_reports_both_sizes(server, tiny):
    """The opt-in field: the engine sees the compressed prompt, usage counts both (the served model's tokens)."""
    from leanlm.prompt.compressor import PromptCompressor

    model, tok = tiny
    c = client(server)
    context = "the quick brown fox jumps over the lazy dog 42 times. hello world, hello there. " * 4
    options = {"rate": 0.4, "question": "how many times?"}
    r = c.completions.create(model=NAME, prompt=context, max_tokens=4, temperature=0,
                             extra_body={"ignore_eos": True, "leanlm": {"compress_prompt": options}})
    compressed = PromptCompressor(model=tiny).compress(context, rate=0.4, question="how many times?").text
    assert r.usage.prompt_tokens == len(tok.encode(compressed)) < r.usage.original_prompt_tokens
    assert r.usage.original_prompt_tokens == len(tok.encode(context)) and r.usage.compression_seconds > 0
    assert r.choices[0].text == tok.decode(greedy(model, tok, compressed, 4))
    chat = c.chat.completions.create(model=NAME, max_tokens=3, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": context}],
        extra_body={"leanlm": {"compress_prompt": {"rate": 0.5}}})
    assert chat.usage.prompt_tokens < chat.usage.original_prompt_tokens
    plain = c.completions.create(model=NAME, prompt=context, max_tokens=1)
    assert plain.usage.prompt_tokens == len(tok.encode(context)) and "original_prompt_tokens" not in plain.usage.model_extra


def test_compress_prompt_auto_compresses_only_where_the_measured_break_even_says_it_pays(server, tiny):
    """auto: the costs are measured once; a prompt at least break_even_tokens long is compressed, a shorter one
    goes to the engine as sent; keeping everything (rate 1) never pays."""
    _, tok = tiny
    c = client(server)
    context = "the quick brown fox jumps over the lazy dog 42 times. hello world, hello there. " * 12
    for prompt in (context, context[:200]):
        r = c.completions.create(model=NAME, prompt=prompt, max_tokens=1, extra_body={
            "leanlm": {"compress_prompt": {"auto": True, "method": "random", "rate": 0.3}}})
        extra, n = r.usage.model_extra, len(tok.encode(prompt))
        assert extra["original_prompt_tokens"] == n and extra["break_even_tokens"] is not None
        if extra["compressed_prompts"]:
            assert n >= extra["break_even_tokens"] and r.usage.prompt_tokens < n
        else:
            assert n < extra["break_even_tokens"] and r.usage.prompt_tokens == n
    never = c.completions.create(model=NAME, prompt=context, max_tokens=1, extra_body={
        "leanlm": {"compress_prompt": {"auto": True, "method": "random", "rate": 1.0}}})
    assert never.usage.model_extra["compressed_prompts"] == 0 and never.usage.model_extra["break_even_tokens"] is None
    assert never.usage.prompt_tokens == len(tok.encode(context))
    # a question the client gave apart still reaches the model, where compression would have put it
    asked = c.completions.create(model=NAME, prompt=context, max_tokens=1, extra_body={
        "leanlm": {"compress_prompt": {"auto": True, "method": "random", "rate": 1.0, "question": "how many?"}}})
    assert asked.usage.prompt_tokens == len(tok.encode(context.rstrip("\n") + "\n\nhow many?"))


def test_api_key_metrics_and_health(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "hi"},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/health").status_code == 200
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_sum", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert name in text, name
    assert 'model_name="tiny"' in text


def test_kv_pressure_preempts_and_all_complete_and_a_full_queue_says_retry(tiny):
    model, tok = tiny
    from leanlm.cache.paged import KVPool

    blocks = 32  # one 60-token request needs ~20 blocks of 4: two running at once already overflow
    s = Server(model, tok, block_size=4, kv_cache_memory=blocks * KVPool.bytes_per_block(model.config, 4, model.dtype),
               max_requests=12)
    try:
        prompts = [f"hello world {i} the quick brown fox" for i in range(12)]
        expected = [tok.decode(greedy(model, tok, p, 60)) for p in prompts]

        async def main():
            async with openai.AsyncOpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0) as c:
                tasks = [c.completions.create(model=NAME, prompt=p, max_tokens=60, temperature=0,
                                              extra_body={"ignore_eos": True}) for p in prompts]
                done = asyncio.gather(*tasks)
                while s.app.state.active < 12:  # every slot taken
                    await asyncio.sleep(0.005)
                async with httpx.AsyncClient(base_url=s.url) as http:
                    busy = await http.post("/v1/completions", json={"model": NAME, "prompt": "x"},
                                           headers={"Authorization": f"Bearer {KEY}"})
                return await done, busy

        results, busy = asyncio.run(main())
        assert [r.choices[0].text for r in results] == expected
        assert s.llm.engine.scheduler.num_preemptions > 0
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert s.settled()
    finally:
        s.stop()


def running(pid: int) -> bool:
    """Not exited: a zombie has exited (nothing here may reap one reparented to init)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("front", ["--engine-thread", "--engine-process"])
def test_leanlm_serve_drains_on_sigterm(tiny_dir, front):
    """The CLI verb as deployed (its key from a file, its name the directory's): SIGTERM mid-stream lets the stream
    finish, then the process exits, and its engine's process, if it has one, with it."""
    import signal
    import subprocess

    port = free_port()
    key_file = tiny_dir / "key.txt"
    key_file.write_text("from-a-file\n")
    proc = subprocess.Popen(leanlm_command("serve", str(tiny_dir), "--port", str(port), "--dtype", "float32", "--threads",
                                           "1", "--kv-cache-memory", "16MiB", "--api-key-file", str(key_file),
                                           front),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() else "no start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401
        core = [int(pid) for f in Path(f"/proc/{proc.pid}/task").glob("*/children") for pid in f.read_text().split()]
        assert bool(core) == (front == "--engine-process")
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="from-a-file", max_retries=0)
        assert [m.id for m in c.models.list().data] == [tiny_dir.name]  # its name, never the path
        stream = c.completions.create(model=tiny_dir.name, prompt="hello", max_tokens=200, temperature=0, stream=True,
                                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage = None
        for i, chunk in enumerate(stream):
            if i == 0:
                proc.send_signal(signal.SIGTERM)
            usage = chunk.usage or usage
        assert usage.completion_tokens == 200  # the request in flight finished
        # uvicorn re-raises the signal once drained: the process ends as terminated by SIGTERM, conventionally
        assert proc.wait(30) in (0, -signal.SIGTERM)
        deadline = time.time() + 10  # exited: gone, or a zombie that no init here reaps
        while any(running(pid) for pid in core):
            assert time.time() < deadline, "the engine's process outlived the server"
            time.sleep(0.1)
        assert proc.stdout.read() == ""  # uvicorn's access log goes to stderr with the rest of the log
        assert "leanlm: ready in " in proc.stderr.read()  # its start-up time, printed
    finally:
        proc.kill()


def test_after_an_engine_failure_every_request_gets_a_prompt_503_and_health_says_so(tiny):
    s = Server(*tiny, kv_cache_memory=1 << 24)
    try:
        def broken():
            raise RuntimeError("boom")

        s.llm.engine.step = broken
        headers = {"Authorization": f"Bearer {KEY}"}
        body = {"model": NAME, "prompt": "hi", "max_tokens": 3}
        r = httpx.post(s.url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 503 and "boom" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "server_error"
        later = httpx.post(s.url + "/v1/completions", json={**body, "stream": True}, headers=headers, timeout=30)
        assert later.status_code == 503 and "not running" in later.json()["error"]["message"]
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503 and "boom" in health.json()["error"]["message"]
    finally:
        s.stop()
