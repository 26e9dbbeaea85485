"""The OpenAI-compatible HTTP app: /v1/completions, /v1/chat/completions (server-sent events when streaming),
/v1/models, /health, /metrics, on an engine front end (engine.llm.EngineFront: AsyncLLM, the engine stepping on its
own thread, or engine.process.EngineProcess, in a process of its own).

A request's completions come back on one asyncio queue. Work stops when its client goes: a streaming response
closes its run when sending fails or ends (`_Stream`); a non-streaming one checks the connection while it waits.
Tokenizing and chat-template rendering run off the event loop, so a huge prompt stalls no other stream."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from leanlm.engine.llm import EngineFront, EngineStopped
from leanlm.engine.sequence import Delta
from leanlm.errors import LeanLMError
from leanlm.generation.grammar import GrammarSpec
from leanlm.generation.sampling import TokenLogprobs
from leanlm.serve.metrics import Metrics
from leanlm.serve.prompts import PromptCompression
from leanlm.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                   error_body)
from leanlm.serve.tools import ChatOutput, forced_schema, template_messages, validate_tools

MAX_BODY = 10 << 20  # bytes of a request body
MAX_PROMPTS = 256  # prompts in one completions request


class EngineFailed(RuntimeError):
    """The engine thread died while a request waited: a 503, not the client's fault."""


class _Completion:
    """One choice as it grows: text, token count, logprobs, finish reason, timings for the metrics."""

    def __init__(self):
        self.text, self.tokens, self.logprobs, self.finish_reason = "", 0, [], None
        self.prompt_logprobs: list | None = None  # asked for: on the first completion of each prompt
        self.last: float | None = None


class _Run:
    """The engine requests behind one HTTP request (one per prompt, n completions each) and their shared queue.
    Made by `_Run.start`, which tokenizes and checks every prompt off the event loop before any is queued."""

    def __init__(self, llm: EngineFront, metrics: Metrics, requests: list, params, on_done):
        self.llm, self.metrics, self.params, self.on_done = llm, metrics, params, on_done
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ids = [seqs[0].request_id for seqs in requests]
        self.prompt_ids = [seqs[0].prompt_ids for seqs in requests]
        self.prompt_tokens = sum(len(ids) for ids in self.prompt_ids)
        self.start = time.perf_counter()
        self.choices = [_Completion() for _ in range(len(requests) * params.n)]
        self.left, self.closed = len(self.choices), False
        self.compression: dict = {}  # usage fields of a compressed prompt
        for i, seqs in enumerate(requests):
            try:
                self.llm.submit(seqs, self.queue)
            except BaseException:
                self.ids = self.ids[:i]
                self.abort()
                raise

    @classmethod
    async def start(cls, llm: EngineFront, metrics: Metrics, prompts: list, params, chat: bool, on_done,
                    render=None) -> _Run:
        """render: prompt -> token ids (a chat with tools), else the engine renders and tokenizes."""
        make = llm.make_request
        requests = await asyncio.to_thread(lambda: [make(uuid.uuid4().hex, render(p), params) if render else
                                                    make(uuid.uuid4().hex, p, params, chat) for p in prompts])
        need = sum(params.n * (len(seqs[0].prompt_ids) + (params.max_tokens or 1)) for seqs in requests)
        if need > llm.limits.capacity:  # admitted, it could only run by preempting itself
            raise RequestTooLarge(f"this request needs {need} tokens of KV cache ({len(requests)} prompts x n="
                                  f"{params.n}, prompt + max_tokens each); the server holds {llm.limits.capacity}: "
                                  f"send fewer prompts, a smaller n or max_tokens")
        return cls(llm, metrics, requests, params, on_done)

    def index(self, delta: Delta) -> int:
        return self.ids.index(delta.request_id) * self.params.n + delta.index

    def take(self, delta) -> tuple[int, Delta]:
        """(choice index, delta) for an item of the queue, recorded."""
        if isinstance(delta, BaseException):
            raise EngineFailed(f"the engine failed: {delta}")
        i = self.index(delta)
        self._record(self.choices[i], delta)
        self.left -= delta.finish_reason is not None
        return i, delta

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) until every choice finished; aborts what is left if the consumer stops."""
        try:
            while self.left:
                yield self.take(await self.queue.get())
        finally:
            self.close()

    def _record(self, choice: _Completion, delta: Delta) -> None:
        now, m = time.perf_counter(), self.metrics
        if choice.last is None:
            m.ttft.observe(now - self.start)
        elif delta.token_ids:
            for _ in delta.token_ids:  # a speculative step adds several tokens at once
                m.itl.observe((now - choice.last) / len(delta.token_ids))
        choice.last = now
        choice.text += delta.text
        choice.tokens += len(delta.token_ids)
        choice.logprobs += delta.logprobs or []
        choice.prompt_logprobs = delta.prompt_logprobs or choice.prompt_logprobs
        m.generation_tokens.inc(len(delta.token_ids))
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
            m.e2e.observe(now - self.start)
            m.finished(delta.finish_reason)

    def abort(self) -> None:
        for request_id in self.ids:
            self.llm.abort(request_id)

    def close(self) -> None:
        """Once per run, however it ends: unfinished work aborted (its blocks freed), finished requests released."""
        if self.closed:
            return
        self.closed = True
        if self.left:
            self.abort()
        else:
            for request_id in self.ids:
                self.llm.release(request_id)
        self.on_done()

    def usage(self) -> dict:
        completion = sum(c.tokens for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion, **self.compression}


class RequestTooLarge(LeanLMError):
    """More than the server can hold for one request: a 413."""


def fail(message: str, code: int = 400, kind: str = "invalid_request_error", headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, code), status_code=code, headers=headers)


class _Guard:
    """API key and body size checked before routing: the body is read here, counting the bytes that arrive
    (chunked transfer has no Content-Length to trust), then replayed to the app. Plain ASGI: Starlette's
    `@app.middleware` would pass every response, each streamed chunk of it, through memory streams and a task."""

    def __init__(self, app, api_key: str | None):
        self.app, self.key = app, None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        too_big = fail(f"request body over {MAX_BODY >> 20} MiB", 413)
        if self.key and scope["path"].startswith("/v1/") and not hmac.compare_digest(
                headers.get(b"authorization", b""), self.key):
            return await fail("invalid or missing API key (Authorization: Bearer KEY)", 401,
                              "authentication_error")(scope, receive, send)
        if int(headers.get(b"content-length") or 0) > MAX_BODY:
            return await too_big(scope, receive, send)
        body, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left mid-body
                return
            body.append(message.get("body", b""))
            more = message.get("more_body", False)
            if sum(map(len, body)) > MAX_BODY:
                return await too_big(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(body), "more_body": False}

        await self.app(scope, replay, send)


def build_app(llm: EngineFront, model_name: str, api_key: str | None = None, max_requests: int = 512,
              prompt_scorer="smollm2-135m", max_n: int = 16, prepare_compression: str | None = None) -> FastAPI:
    """max_requests: HTTP requests in progress beyond which new ones get 503 and Retry-After (the queue is bounded
    here, not left to grow in the engine). prompt_scorer: the model that compresses prompts that ask for it (the
    "leanlm": {"compress_prompt": {...}} field), loaded on first use, or a PromptCompressor. max_n: the most
    completions one request may ask for. prepare_compression: a compression method made ready (its models loaded
    or made, its break-even measured) before this returns, so that no request waits on it."""
    app = FastAPI(title="leanlm", docs_url=None, redoc_url=None)
    app.state.active = 0  # HTTP requests admitted and not yet answered in full
    metrics = Metrics(llm.stats, model_name)
    tok = llm.tokenizer
    compression = PromptCompression(prompt_scorer, llm.prefill_seconds, llm.limits.max_position)
    if prepare_compression:
        seconds = compression.prepare(prepare_compression, tok)
        print(f"leanlm: prompt compression ({prepare_compression}) ready in {seconds:.1f} s", file=sys.stderr)
    app.add_middleware(_Guard, api_key=api_key)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return fail(f"{where + ': ' if where else ''}{first.get('msg', 'invalid request')}")

    @app.exception_handler(LeanLMError)
    async def refused(request: Request, exc: LeanLMError):
        return fail(str(exc))

    @app.exception_handler(RequestTooLarge)
    async def too_large(request: Request, exc: RequestTooLarge):
        return fail(str(exc), 413)

    @app.exception_handler(EngineFailed)
    @app.exception_handler(EngineStopped)
    async def broken(request: Request, exc: Exception):
        return fail(str(exc), 503, "server_error")

    @app.get("/health")
    async def health():
        if llm.error is not None:
            return fail(f"engine stopped: {llm.error}", 503, "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "leanlm",
                                            "max_model_len": llm.limits.max_position}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if (body.prompt is None) == (body.messages is None):
            raise LeanLMError("give either prompt or messages")
        if body.messages is not None:
            messages = template_messages([m.as_template_input() for m in body.messages])
            text = await asyncio.to_thread(tok.apply_chat_template, messages, body.add_generation_prompt)
            ids = await asyncio.to_thread(tok.encode, text, False)
        else:
            ids = await asyncio.to_thread(tok.encode, body.prompt, body.add_special_tokens)
        strs = [_token_text(tok, t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": llm.limits.max_position, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        vocab = llm.limits.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise LeanLMError(f"tokens must be ids in [0, {vocab})")
        return {"prompt": await asyncio.to_thread(tok.decode, body.tokens)}

    async def start(body, prompts: list, params, chat: bool, render=None) -> _Run | JSONResponse:
        if body.model != model_name:
            return fail(f"model {body.model!r} does not exist; this server serves {model_name!r}", 404)
        if params.n > max_n:
            raise LeanLMError(f"n must be at most {max_n} on this server (leanlm serve --max-n), got {params.n}")
        if len(prompts) > MAX_PROMPTS:
            raise LeanLMError(f"a request may carry at most {MAX_PROMPTS} prompts, got {len(prompts)}")
        if app.state.active >= max_requests:
            return fail(f"server busy: {max_requests} requests in progress", 503, "server_error",
                        {"Retry-After": "1"})
        app.state.active += 1  # from here: a request waiting on prompt compression counts against max_requests too
        try:
            usage = {}
            if body.leanlm and body.leanlm.compress_prompt:
                prompts, usage = await compression.apply(body.leanlm.compress_prompt, prompts, chat, tok)
            run = await _Run.start(llm, metrics, prompts, params, chat, done, render)
        except BaseException:  # not admitted after all (a _Run that raises never calls done)
            app.state.active -= 1
            raise
        run.compression = usage
        metrics.prompt_tokens.inc(run.prompt_tokens)
        return run

    def done() -> None:
        app.state.active -= 1

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts = body.prompts()
        run = await start(body, prompts, body.params(), chat=False)
        if isinstance(run, JSONResponse):
            return run
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name}

        # echoed prompts as sent; token ids decoded (off the loop, and only when asked for)
        prompt_texts = await asyncio.to_thread(lambda: [p if isinstance(p, str) else tok.decode(p) for p in prompts]
                                               if body.echo else [])

        def choice(i: int, text: str, logprobs: list, finish: str | None, first: bool) -> dict:
            """first: the choice's first piece, which carries the echoed prompt and the prompt's logprobs."""
            p, out = i // body.n, {"index": i, "text": text, "finish_reason": finish, "logprobs": None}
            prompt_logprobs = run.choices[p * body.n].prompt_logprobs
            if body.echo and first:
                out["text"] = prompt_texts[p] + text
                if prompt_logprobs is not None:  # the first prompt token has no log-probability
                    logprobs = [TokenLogprobs(run.prompt_ids[p][0], None, []), *prompt_logprobs[1:], *logprobs]
            if body.logprobs is not None:
                out["logprobs"] = _completion_logprobs(tok, logprobs)
            if body.prompt_logprobs is not None and first:
                out["prompt_logprobs"] = _prompt_logprobs(tok, prompt_logprobs)
            return out

        if body.stream:
            return _sse(run, head, body, lambda i, d: [choice(i, d.text, d.logprobs or [], d.finish_reason,
                                                              run.choices[i].tokens == len(d.token_ids))])
        if not await _wait(run, request):
            return Response(status_code=499)
        return {**head, "usage": run.usage(), "choices": [
            choice(i, c.text, c.logprobs, c.finish_reason, True) for i, c in enumerate(run.choices)]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        tools = validate_tools(body.tools)
        tool_choice = body.tool_choice or ("auto" if tools else "none")
        params = body.params()
        if (forced := forced_schema(tools, tool_choice, body.parallel_tool_calls)) is not None:
            if params.grammar is not None:
                raise LeanLMError("a forced tool_choice already constrains the output: drop response_format")
            params = dataclasses.replace(params, grammar=GrammarSpec("json_schema", json.dumps(forced)))
        messages = template_messages([m.as_template_input() for m in body.messages])

        def render(messages: list[dict]) -> list[int]:  # tools through the model's own template
            return tok.encode(tok.apply_chat_template(messages, tools=tools or None), add_special_tokens=False)

        run = await start(body, [messages], params, True, render)
        if isinstance(run, JSONResponse):
            return run
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": model_name}
        output = ChatOutput(tools, tool_choice)

        def finish(reason: str | None, calls: bool) -> str | None:
            return "tool_calls" if calls and reason == "stop" else reason

        def logprobs(items: list) -> dict | None:
            return {"content": [_chat_logprob(tok, x) for x in items]} if body.logprobs else None

        if body.stream:
            streams = [output.stream() for _ in run.choices]
            calls = [False] * len(run.choices)

            def chunks(i: int, d: Delta) -> list[dict]:
                deltas = streams[i].feed(d.text) + (streams[i].finish() if d.finish_reason is not None else [])
                calls[i] = calls[i] or any("tool_calls" in x for x in deltas)
                if run.choices[i].tokens == len(d.token_ids):  # the choice's first chunk says who speaks
                    deltas = [{"role": "assistant", **(deltas[0] if deltas else {"content": ""})}, *deltas[1:]]
                out = [{"index": i, "delta": x, "logprobs": None, "finish_reason": None} for x in deltas]
                if not out and (d.logprobs or d.finish_reason is not None):
                    out = [{"index": i, "delta": {}, "logprobs": None, "finish_reason": None}]
                if out:
                    out[-1].update(logprobs=logprobs(d.logprobs or []),
                                   finish_reason=finish(d.finish_reason, calls[i]))
                return out

            return _sse(run, {**head, "object": "chat.completion.chunk"}, body, chunks)
        if not await _wait(run, request):
            return Response(status_code=499)
        choices = []
        for i, c in enumerate(run.choices):
            message, has_calls = output.message(c.text)
            choices.append({"index": i, "message": message, "logprobs": logprobs(c.logprobs),
                            "finish_reason": finish(c.finish_reason, has_calls)})
        return {**head, "usage": run.usage(), "choices": choices}

    return app


async def _wait(run: _Run, request: Request, poll: float = 0.25) -> bool:
    """Drain a non-streaming run; False (and its work aborted) if the client went away meanwhile (looked at every
    `poll` seconds, whether tokens are arriving or not)."""
    pending, looked = None, time.monotonic()
    try:
        while run.left:
            pending = pending or asyncio.ensure_future(run.queue.get())
            done, _ = await asyncio.wait({pending}, timeout=poll)
            if done:
                run.take(pending.result())
                pending = None
            if time.monotonic() - looked >= poll:
                if await request.is_disconnected():
                    return False
                looked = time.monotonic()
        return True
    finally:
        if pending is not None:
            pending.cancel()
        run.close()


def _sse(run: _Run, head: dict, body, choices) -> StreamingResponse:
    """Server-sent events: a chunk per piece of a delta (`choices(i, delta)`: the choice dicts it makes), then
    (stream_options.include_usage) a chunk with usage and no choices, then [DONE]. Usage rides alone, as OpenAI
    sends it: some clients ignore it beside choices."""

    async def events():
        try:
            async for i, delta in run.deltas():
                for piece in choices(i, delta):
                    yield f"data: {json.dumps({**head, 'choices': [piece]})}\n\n"
            if body.stream_options and body.stream_options.include_usage:
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': run.usage()})}\n\n"
        except EngineFailed as e:
            yield f"data: {json.dumps(error_body(str(e), 'server_error', 503))}\n\n"
        yield "data: [DONE]\n\n"

    return _Stream(run, events())


class _Stream(StreamingResponse):
    """An SSE response that closes its run even when the client is gone before the first chunk: then Starlette
    never starts the body generator, so the generator's own cleanup would never run."""

    def __init__(self, run: _Run, events: AsyncIterator[str]):
        super().__init__(events, media_type="text/event-stream")
        self.run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()


def _token_text(tok, token: int) -> str:
    return tok.decode([token], skip_special_tokens=False)


def _completion_logprobs(tok, items: list) -> dict:
    """The legacy completions layout: parallel lists of tokens, their logprobs and top alternatives."""
    tokens = [_token_text(tok, x.token) for x in items]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    # an echoed prompt's first token has no log-probability and no alternatives: null, as OpenAI sends it
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in items], "text_offset": offsets,
            "top_logprobs": [None if x.logprob is None else {_token_text(tok, t): lp for t, lp in x.top}
                             for x in items]}


def _prompt_logprobs(tok, items: list) -> list:
    """vLLM's prompt_logprobs: None for the first prompt token, then {token id: {logprob, rank, decoded_token}}
    holding the prompt's token and the top alternatives."""
    return [None if x is None else {str(t): {"logprob": lp, "rank": rank, "decoded_token": _token_text(tok, t)}
                                    for t, lp, rank in [*((t, lp, i + 1) for i, (t, lp) in enumerate(x.top)),
                                                        (x.token, x.logprob, x.rank)]} for x in items]


def _chat_logprob(tok, x) -> dict:
    text = _token_text(tok, x.token)
    return {"token": text, "logprob": x.logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t := _token_text(tok, i)), "logprob": lp, "bytes": list(t.encode())}
                             for i, lp in x.top]}
