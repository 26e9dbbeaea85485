"""The OpenAI-compatible HTTP app: /v1/completions, /v1/chat/completions (server-sent events when streaming),
/v1/models, /health, /metrics, on an AsyncLLM whose engine steps on its own thread.

A request's completions come back on one asyncio queue. Work stops when its client goes: a streaming response
closes its run when sending fails or ends (`_Stream`); a non-streaming one checks the connection while it waits."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from leanlm.engine.llm import AsyncLLM
from leanlm.engine.sequence import Delta
from leanlm.errors import LeanLMError
from leanlm.serve.metrics import Metrics
from leanlm.serve.prompts import PromptCompression
from leanlm.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body

MAX_BODY = 10 << 20  # bytes of a request body


class EngineFailed(RuntimeError):
    """The engine thread died: a 500, not the client's fault."""


class _Completion:
    """One choice as it grows: text, token count, logprobs, finish reason, timings for the metrics."""

    def __init__(self):
        self.text, self.tokens, self.logprobs, self.finish_reason = "", 0, [], None
        self.last: float | None = None


class _Run:
    """The engine requests behind one HTTP request (one per prompt, n completions each) and their shared queue."""

    def __init__(self, llm: AsyncLLM, metrics: Metrics, prompts: list, params, chat: bool, on_done):
        self.llm, self.metrics, self.params, self.on_done = llm, metrics, params, on_done
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ids, self.prompt_tokens = [], 0
        self.start = time.perf_counter()
        try:
            for prompt in prompts:
                seqs, _ = llm.add_request(prompt, params, uuid.uuid4().hex, chat, self.queue)
                self.ids.append(seqs[0].request_id)
                self.prompt_tokens += len(seqs[0].prompt_ids)
        except LeanLMError:
            self.abort()
            raise
        self.choices = [_Completion() for _ in range(len(prompts) * params.n)]
        self.left, self.closed = len(self.choices), False
        self.compression: dict = {}  # usage fields of a compressed prompt

    def index(self, delta: Delta) -> int:
        return self.ids.index(delta.request_id) * self.params.n + delta.index

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) until every choice finished; aborts what is left if the consumer stops."""
        try:
            while self.left:
                delta = await self.queue.get()
                if isinstance(delta, BaseException):
                    raise EngineFailed(f"the engine failed: {delta}")
                i = self.index(delta)
                self._record(self.choices[i], delta)
                self.left -= delta.finish_reason is not None
                yield i, delta
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


def fail(message: str, code: int = 400, kind: str = "invalid_request_error", headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, code), status_code=code, headers=headers)


class _Guard:
    """Body size and API key checked before routing. Plain ASGI: Starlette's `@app.middleware` would pass every
    response, each streamed chunk of it, through memory streams and a task of its own."""

    def __init__(self, app, api_key: str | None):
        self.app, self.key = app, None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            refusal = None
            if int(headers.get(b"content-length") or 0) > MAX_BODY:
                refusal = fail(f"request body over {MAX_BODY >> 20} MiB", 413)
            elif self.key and scope["path"].startswith("/v1/") and headers.get(b"authorization") != self.key:
                refusal = fail("invalid or missing API key (Authorization: Bearer KEY)", 401, "authentication_error")
            if refusal is not None:
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)


def build_app(llm: AsyncLLM, model_name: str, api_key: str | None = None, max_requests: int = 512,
              prompt_scorer="smollm2-135m") -> FastAPI:
    """max_requests: HTTP requests in progress beyond which new ones get 503 and Retry-After (the queue is bounded
    here, not left to grow in the engine). prompt_scorer: the model that compresses prompts that ask for it (the
    "leanlm": {"compress_prompt": {...}} field), loaded on first use, or a PromptCompressor."""
    app = FastAPI(title="leanlm", docs_url=None, redoc_url=None)
    app.state.active = 0  # HTTP requests admitted and not yet answered in full
    metrics = Metrics(llm.engine, model_name)
    tok = llm.tokenizer
    compression = PromptCompression(prompt_scorer)
    app.add_middleware(_Guard, api_key=api_key)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return fail(f"{where + ': ' if where else ''}{first.get('msg', 'invalid request')}")

    @app.exception_handler(LeanLMError)
    async def refused(request: Request, exc: LeanLMError):
        return fail(str(exc))

    @app.exception_handler(EngineFailed)
    async def broken(request: Request, exc: EngineFailed):
        return fail(str(exc), 500, "server_error")

    @app.get("/health")
    async def health():
        if llm.error is not None:
            return fail(f"engine stopped: {llm.error}", 503, "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "leanlm",
                                            "max_model_len": llm.engine.model.config.max_position}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def start(body, prompts: list, params, chat: bool) -> _Run | JSONResponse:
        if body.model != model_name:
            return fail(f"model {body.model!r} does not exist; this server serves {model_name!r}", 404)
        if app.state.active >= max_requests:
            return fail(f"server busy: {max_requests} requests in progress", 503, "server_error",
                        {"Retry-After": "1"})
        app.state.active += 1  # from here: a request waiting on prompt compression counts against max_requests too
        try:
            usage = {}
            if body.leanlm and body.leanlm.compress_prompt:
                prompts, usage = await compression.apply(body.leanlm.compress_prompt, prompts, chat, tok)
            run = _Run(llm, metrics, prompts, params, chat, done)
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
        run = await start(body, body.prompts(), body.sampling_params(body.max_tokens, body.logprobs), chat=False)
        if isinstance(run, JSONResponse):
            return run
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name}

        def choice(i: int, text: str, logprobs: list, finish: str | None) -> dict:
            return {"index": i, "text": text, "finish_reason": finish,
                    "logprobs": None if body.logprobs is None else _completion_logprobs(tok, logprobs)}

        if body.stream:
            return _sse(run, head, body, lambda i, d: choice(i, d.text, d.logprobs or [], d.finish_reason))
        if not await _wait(run, request):
            return Response(status_code=499)
        return {**head, "usage": run.usage(),
                "choices": [choice(i, c.text, c.logprobs, c.finish_reason) for i, c in enumerate(run.choices)]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        messages = [m.as_template_input() for m in body.messages]
        top = body.top_logprobs or 0 if body.logprobs else None
        run = await start(body, [messages], body.sampling_params(body.max_completion_tokens or body.max_tokens, top),
                          True)
        if isinstance(run, JSONResponse):
            return run
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": model_name}

        def logprobs(items: list) -> dict | None:
            return {"content": [_chat_logprob(tok, x) for x in items]} if body.logprobs else None

        if body.stream:
            def chunk(i: int, d: Delta) -> dict:
                first = run.choices[i].tokens == len(d.token_ids)
                delta = {"role": "assistant", "content": d.text} if first else {"content": d.text}
                return {"index": i, "delta": delta, "logprobs": logprobs(d.logprobs or []),
                        "finish_reason": d.finish_reason}

            return _sse(run, {**head, "object": "chat.completion.chunk"}, body, chunk)
        if not await _wait(run, request):
            return Response(status_code=499)
        return {**head, "usage": run.usage(), "choices": [
            {"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs(c.logprobs),
             "finish_reason": c.finish_reason} for i, c in enumerate(run.choices)]}

    return app


async def _wait(run: _Run, request: Request, poll: float = 0.25) -> bool:
    """Drain a non-streaming run; False (and its work aborted) if the client went away meanwhile."""
    deltas = run.deltas()
    pending = asyncio.ensure_future(anext(deltas, None))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=poll)
            if not done:
                if await request.is_disconnected():
                    return False
                continue
            if pending.result() is None:
                return True
            pending = asyncio.ensure_future(anext(deltas, None))
    finally:
        pending.cancel()
        await deltas.aclose()


def _sse(run: _Run, head: dict, body, choice) -> StreamingResponse:
    """Server-sent events: a chunk per delta, then (stream_options.include_usage) a chunk with usage and no
    choices, then [DONE]. Usage rides alone, as OpenAI sends it: some clients ignore it beside choices."""

    async def events():
        try:
            async for i, delta in run.deltas():
                yield f"data: {json.dumps({**head, 'choices': [choice(i, delta)]})}\n\n"
            if body.stream_options and body.stream_options.include_usage:
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': run.usage()})}\n\n"
        except EngineFailed as e:
            yield f"data: {json.dumps(error_body(str(e), 'server_error', 500))}\n\n"
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
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in items], "text_offset": offsets,
            "top_logprobs": [{_token_text(tok, t): lp for t, lp in x.top} for x in items]}


def _chat_logprob(tok, x) -> dict:
    text = _token_text(tok, x.token)
    return {"token": text, "logprob": x.logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t := _token_text(tok, i)), "logprob": lp, "bytes": list(t.encode())}
                             for i, lp in x.top]}
