"""The protocol as vLLM speaks it, and the server's bounds: each test here failed on the server before #36."""

import asyncio
import copy
import json
import threading
import time

import httpx
import pytest
import torch

from serving import KEY, NAME, Server, client, greedy

from leanlm.generation.sampling import SamplingParams
from leanlm.lowbit.linear import Int8OutlierLinear

HEADERS = {"Authorization": f"Bearer {KEY}"}


def post(server, path: str, body, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=HEADERS, timeout=60, **kw)


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1 by one full forward  # [len(ids) - 1]"""
    with torch.no_grad():
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], None)[0].float()
    return logits[:-1].log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_echo_with_logprobs_returns_the_prompts_tokens_and_their_logprobs(server, tiny):
    """lm-eval's local-completions scores a continuation by these: the prompt echoed with its log-probabilities."""
    model, tok = tiny
    texts = ["the quick brown fox jumps over the lazy dog", "hello world, hello there"]
    ids = [tok.encode(t) for t in texts]
    r = post(server, "/v1/completions", {"model": NAME, "prompt": ids, "max_tokens": 1, "temperature": 0,
                                          "logprobs": 2, "echo": True}).json()
    for choice, prompt in zip(r["choices"], ids):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None and len(lp["top_logprobs"][1]) >= 1
        want = reference_logprobs(model, prompt)
        assert torch.allclose(torch.tensor(lp["token_logprobs"][1 : len(prompt)]), want, atol=1e-4)
        assert choice["text"].startswith(tok.decode(prompt))
    # a shared prefix must not skip the prompt positions: the second time it is in the prefix cache. Close, not
    # equal: the second time its rows run in a step of another shape (alone, part of it cached), whose products
    # may sum in another order (on Zen 4 a log-probability moved by 5e-7; equal on the AMX box)
    again = post(server, "/v1/completions", {"model": NAME, "prompt": ids[0], "max_tokens": 1, "logprobs": 0,
                                              "echo": True}).json()
    assert torch.allclose(torch.tensor(again["choices"][0]["logprobs"]["token_logprobs"][1 : len(ids[0])]),
                          torch.tensor(r["choices"][0]["logprobs"]["token_logprobs"][1 : len(ids[0])]), atol=1e-4)
    # vLLM's prompt_logprobs field, streaming too
    chunks = []
    with httpx.stream("POST", server.url + "/v1/completions", headers=HEADERS, timeout=60, json={
            "model": NAME, "prompt": texts[1], "max_tokens": 3, "prompt_logprobs": 1, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    first = chunks[0]["choices"][0]["prompt_logprobs"]
    assert first[0] is None and len(first) == len(ids[1])
    assert all(str(t) in entry for t, entry in zip(ids[1][1:], first[1:]))
    with torch.no_grad():  # a token's rank: 1 + the ids more likely than it
        logits = tiny[0](torch.tensor([ids[1]]), torch.arange(len(ids[1]))[None], None)[0, :-1]
    want = (logits > logits.gather(-1, torch.tensor(ids[1][1:])[:, None])).sum(-1) + 1
    assert [entry[str(t)]["rank"] for t, entry in zip(ids[1][1:], first[1:])] == want.tolist()
    assert all("prompt_logprobs" not in c["choices"][0] for c in chunks[1:])


def test_max_tokens_defaults_to_the_rest_of_the_context(server, tiny):
    model, _ = tiny
    chat = client(server).chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                  temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == model.config.max_position


def test_penalties_and_logit_bias_are_honoured(server, tiny):
    model, tok = tiny
    c = client(server)
    plain = tok.decode(greedy(model, tok, "hello world", 12))
    body = dict(model=NAME, prompt="hello world", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert c.completions.create(**body).choices[0].text == plain
    # a frequency penalty of 2 over 12 tokens of a tiny vocabulary changes the greedy path
    penalised = c.completions.create(**body, frequency_penalty=2.0, presence_penalty=1.0).choices[0].text
    assert penalised != plain
    favourite = tok.encode("fox", add_special_tokens=False)[0]
    biased = c.completions.create(**body, logit_bias={str(favourite): 100})
    assert biased.choices[0].text == tok.decode([favourite] * 12)


def test_tokenize_and_detokenize(server, tiny):
    _, tok = tiny
    r = post(server, "/tokenize", {"model": NAME, "prompt": "hello world"}).json()
    assert r["tokens"] == tok.encode("hello world") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]),
                                        add_special_tokens=False)
    assert post(server, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": tok.decode(r["tokens"])}
    assert post(server, "/detokenize", {"tokens": [10 ** 6]}).status_code == 400


@pytest.mark.parametrize("payload,status,words", [
    ({"model": NAME, "prompt": []}, 400, "non-empty"),
    ({"model": NAME, "prompt": [[]]}, 400, "non-empty"),
    ({"model": NAME, "prompt": "hi", "response_formt": {}}, 400, "response_formt"),  # a typo is named, not dropped
    ({"model": NAME, "prompt": "hi", "best_of": 3}, 400, "best_of"),
    ({"model": NAME, "prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ({"model": NAME, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "n": 17}, 400, "max-n"),
    ({"model": NAME, "prompt": ["hi"] * 257}, 400, "256 prompts"),
    ({"model": NAME, "prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"model": NAME, "prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"model": NAME, "prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"model": NAME, "prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"model": NAME, "prompt": ["hello world"] * 200, "n": 16, "max_tokens": 400}, 413, "KV cache"),
])
def test_requests_beyond_what_the_server_honours_are_refused_by_name(server, payload, status, words):
    r = post(server, "/v1/completions", payload)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]
    assert server.settled()


@pytest.mark.parametrize("fields, words", [
    ({"modalities": ["audio"]}, "modalities"),
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true, as OpenAI and vLLM refuse it
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true
])
def test_chat_fields_it_cannot_honour_are_refused(server, fields, words):
    r = post(server, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                               **fields})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert server.settled()


def test_a_chunked_body_over_the_limit_is_refused_on_the_bytes_read(server):
    from leanlm.serve.app import MAX_BODY

    def chunks():  # no Content-Length: transfer-encoding chunked
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(MAX_BODY // (1 << 20) + 1):
            yield b"x" * (1 << 20)
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=60,
                   headers={**HEADERS, "Content-Type": "application/json"})
    assert r.status_code == 413 and "MiB" in r.json()["error"]["message"]


def test_prompts_are_tokenized_off_the_event_loop(server, monkeypatch):
    llm, threads = server.llm, []
    make = llm.make_request

    def recording(*args, **kw):
        threads.append(threading.current_thread())
        return make(*args, **kw)

    monkeypatch.setattr(llm, "make_request", recording)
    assert post(server, "/v1/chat/completions", {"model": NAME, "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    assert threads and all(t is not server.thread for t in threads)


def test_a_non_streaming_client_that_leaves_is_aborted_without_an_asgi_error(server, monkeypatch):
    """Called as ASGI with a client that disconnects once the body is read: the app returns (no exception, such as
    'aclose(): asynchronous generator is already running'), and the request's work is aborted."""
    step = server.llm.engine.step

    def slow_step():  # so that the request is still running when the server looks at the connection
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(server.llm.engine, "step", slow_step)
    body = json.dumps({"model": NAME, "prompt": "hello", "max_tokens": 400, "ignore_eos": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", server.port),
             "headers": [(b"content-type", b"application/json"), (b"authorization", f"Bearer {KEY}".encode())]}
    sent = []

    async def main():
        messages = [{"type": "http.disconnect"}, {"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            return messages.pop() if len(messages) > 1 else messages[0]  # the body, then the client is gone

        async def send(message):
            sent.append(message)

        await server.app(scope, receive, send)

    asyncio.run(main())
    assert sent[0]["status"] == 499
    assert server.app.state.active == 0 and server.settled(timeout=30)


def test_compile_with_what_it_cannot_compile_warns(tiny, capsys):
    from leanlm.engine import Engine, EngineConfig

    Engine(*tiny, EngineConfig(kv_cache_memory=1 << 22, compile=True, kv_cache="int8"))
    err = capsys.readouterr().err
    assert "compile is off" in err and "int8" in err
    Engine(*tiny, EngineConfig(kv_cache_memory=1 << 22, compile=True, deterministic=True))
    err = capsys.readouterr().err
    assert "compile is off" in err and "deterministic" in err
    model = copy.deepcopy(tiny[0])  # one LLM.int8() layer: its outlier columns come from the data
    name, linear = next((n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    model.set_submodule(name, Int8OutlierLinear.from_float(linear))
    Engine(model, tiny[1], EngineConfig(kv_cache_memory=1 << 22, compile=True))
    err = capsys.readouterr().err
    assert "compile is off" in err and "Int8OutlierLinear layers choose their work from the data" in err


def test_sampling_params_penalties_match_their_definition():
    """OpenAI's: logit - presence * [count > 0] - frequency * count, over the output only."""
    from leanlm.generation.sampling import sample_rows

    torch.manual_seed(0)
    logits = torch.randn(2, 50)
    output = [3, 3, 7, 9, 3]
    p = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={11: 5.0, 60: 3})
    want = logits[0].clone()
    for t in set(output):
        want[t] -= 0.5 + 0.25 * output.count(t)
    want[11] += 5.0
    draws = [sample_rows(logits[:1], [p], [torch.Generator().manual_seed(s)], [None], [None], [output])[0][0]
             for s in range(400)]
    expect = want.softmax(-1)
    freq = torch.bincount(torch.tensor(draws), minlength=50).float() / len(draws)
    assert (freq - expect).abs().max() < 0.08
    greedy_p = SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=2.0)
    first, second = logits[1].topk(2).indices.tolist()  # a gap of 8 (2 + 3 x 2) puts the runner-up ahead
    assert sample_rows(logits[1:], [greedy_p], [None], [None], [None], [[first] * 3])[0][0] == second


def test_draft_speculation_in_the_server_equals_plain_decoding_and_is_counted(tiny):
    """`leanlm serve TARGET --draft DRAFT`: the target as its own draft accepts nearly every proposal; greedy output
    is the target's, and /metrics counts drafts and accepted tokens as vLLM names them."""
    import re

    model, tok = tiny
    s = Server(model, tok, kv_cache_memory=1 << 24, draft=model, num_speculative=3)
    try:
        c = client(s)
        r = c.completions.create(model=NAME, prompt="hello world", max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert r.choices[0].text == tok.decode(greedy(model, tok, "hello world", 12))
        text = httpx.get(s.url + "/metrics").text
        counts = {name: float(re.search(rf'^{name}_total{{model_name="tiny"}} (\S+)', text, re.M).group(1))
                  for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                               "vllm:spec_decode_num_accepted_tokens")}
        assert counts["vllm:spec_decode_num_drafts"] > 0
        assert 0 < counts["vllm:spec_decode_num_accepted_tokens"] <= counts["vllm:spec_decode_num_draft_tokens"]
        assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in text
    finally:
        s.stop()
