"""LLM: the engine facade. `generate` runs many prompts at once (highest throughput); `AsyncLLM` streams each
request's output from an engine stepping on its own thread, so callers (an HTTP server) never stall a step;
`EngineFront` is what it shares with engine.process.EngineProcess, the engine in a process of its own."""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from leanlm.engine.config import OFFLINE_BATCHED_TOKENS, EngineConfig, engine_config
from leanlm.engine.engine import Engine, EngineStats, request_output
from leanlm.engine.intake import Intake, Limits
from leanlm.engine.sequence import Delta, RequestOutput, Sequence
from leanlm.errors import LeanLMError
from leanlm.generation.decode import prefill_seconds
from leanlm.generation.sampling import SamplingParams
from leanlm.models.layers import pack_linears
from leanlm.models.loading import load
from leanlm.runtime import cpu_count, set_threads
from leanlm.tokenizer import Tokenizer


def _engine(model, tokenizer, dtype, device, threads, config: EngineConfig, quiet: bool) -> Engine:
    """Load the model (and a draft named in config) if named, set the threads, build the engine."""
    if isinstance(model, (str, Path)):
        model, tokenizer = load(model, dtype, device)
        if config.pack_weights:  # its own copy: no caller holds these modules
            pack_linears(model)
    elif tokenizer is None:
        raise LeanLMError("LLM(model) with a model object needs its tokenizer too: LLM(model, tokenizer)")
    if config.draft_by_name:
        draft, draft_tokenizer = load(config.draft, dtype, device)
        if not tokenizer.same_vocabulary(draft_tokenizer):
            raise LeanLMError(f"draft {config.draft}: its tokenizer is not the target's; speculation needs one "
                              "vocabulary")
        config = replace(config, draft=draft)
    if model.device.type == "cpu":  # batches are compute-bound: every core helps (override with threads=)
        set_threads(threads or cpu_count())
    engine = Engine(model, tokenizer, config)
    if not quiet:
        print(f"leanlm: {engine.describe()}", file=sys.stderr)
    return engine


class EngineStopped(LeanLMError):
    """The engine is not running (it failed, or was shut down): for a server, a 503 rather than the client's fault."""


class LLM:
    """leanlm.LLM("smollm2-135m").generate(prompts, SamplingParams(...)) -> one RequestOutput per prompt.

    The engine's options: `config=EngineConfig(...)` (leanlm.engine.config), or its fields as keywords, set over
    config when both are given: kv_cache_memory ("1GiB", bytes, or a fraction of free memory such as 0.2),
    block_size, max_num_seqs, max_num_batched_tokens (without a config, engine.config.OFFLINE_BATCHED_TOKENS; a
    server keeps EngineConfig's smaller budget for its decoding requests' TPOT), prefix_caching, kv_cache ("auto":
    the model's dtype, or "int8"), compile (decode steps as compiled graphs of a symbolic batch size: a few graphs,
    each compiled once), deterministic (a request's output independent of its batch, chunking and speculation),
    prompt_lookup (n-gram size, 0 = off), num_speculative (tokens proposed per step) and draft (a model of the same
    tokenizer, or its name or path, that proposes them)."""

    def __init__(self, model, tokenizer=None, *, config: EngineConfig | None = None, dtype=None, device=None,
                 threads: int | None = None, quiet: bool = False, **options):
        if config is None:
            options.setdefault("max_num_batched_tokens", OFFLINE_BATCHED_TOKENS)
        self.engine = _engine(model, tokenizer, dtype, device, threads, engine_config(config, **options), quiet)
        self._ids = itertools.count()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None, chat: bool = False,
                 progress: bool = True) -> list[RequestOutput]:
        """Complete every prompt (text, token ids, or chat messages with chat=True); outputs in prompt order.
        Every request is checked before any runs: one bad prompt raises LeanLMError and nothing is queued."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        params = params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise LeanLMError(f"{len(prompts)} prompts but {len(params)} sampling params")
        requests = [self.engine.make_request(f"gen-{next(self._ids)}", p, sp, chat) for p, sp in zip(prompts, params)]
        for seqs in requests:
            self.engine.add(seqs)
        total = sum(s.max_tokens for seqs in requests for s in seqs)
        with _progress(progress, total) as advance:
            while self.engine.has_work:
                advance(len(self.engine.step()))
        return [request_output(seqs) for seqs in requests]


class _progress:
    """A rich progress bar of generated tokens on stderr (a no-op when off)."""

    def __init__(self, on: bool, total: int):
        self.on, self.total = on, total

    def __enter__(self):
        if not self.on:
            return lambda n: None
        self.bar = Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                            TimeRemainingColumn(), console=Console(stderr=True), transient=True)
        task = self.bar.add_task("generate", total=self.total)
        self.bar.start()
        return lambda n: self.bar.advance(task, n)

    def __exit__(self, *exc):
        if self.on:
            self.bar.stop()


class EngineFront:
    """What a streaming front end to an engine offers (AsyncLLM: the engine on a thread; engine.process.EngineProcess:
    in a process of its own): requests made and checked here, each request's Deltas on an asyncio queue.

    A subclass sets tokenizer, limits and intake, and gives _post (an ("add", seqs) or ("abort", id) on its way to
    the engine), stats, prefill_seconds, compiled and shutdown."""

    tokenizer: Tokenizer
    limits: Limits
    intake: Intake
    compiled: bool  # decode steps run as compiled graphs

    def __init__(self):
        self._ids = itertools.count()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self.error: BaseException | None = None

    def make_request(self, request_id: str, prompt, params: SamplingParams, chat: bool = False) -> list[Sequence]:
        """Tokenize and check a request (any thread: run it off the event loop); LeanLMError on bad input."""
        return self.intake.make(request_id, prompt, params, chat)

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None, chat: bool = False,
                    queue: asyncio.Queue | None = None) -> tuple[list[Sequence], asyncio.Queue]:
        """Queue a request from a running event loop; (its sequences, the queue its Deltas arrive on: `queue`, which
        several requests may share, or a new one). An engine failure arrives on it as an exception object. Read
        only the sequences' ids and prompt: the engine advances its own."""
        self._check_running()
        seqs = self.make_request(request_id or f"req-{next(self._ids)}", prompt, params, chat)
        return seqs, self.submit(seqs, queue)

    def submit(self, seqs: list[Sequence], queue: asyncio.Queue | None = None) -> asyncio.Queue:
        """Queue a request made by make_request (which may run on any thread, e.g. off the event loop)."""
        request_id, queue = seqs[0].request_id, queue or asyncio.Queue()
        self._sinks[request_id] = asyncio.get_running_loop(), queue
        try:
            self._post(("add", seqs))
        except EngineStopped:
            self._sinks.pop(request_id, None)
            raise
        return queue

    def _check_running(self) -> None:
        if self.error is not None or self._stopped:
            raise EngineStopped(f"the engine is not running ({self.error or 'shut down'})")

    async def stream(self, prompt, params: SamplingParams, request_id: str | None = None,
                     chat: bool = False) -> AsyncIterator[Delta]:
        """Deltas of one request until each of its completions finished; aborted if the consumer stops early."""
        seqs, queue = self.add_request(prompt, params, request_id, chat)
        request_id = seqs[0].request_id
        done = 0
        try:
            while done < params.n:
                delta = await queue.get()
                if isinstance(delta, LeanLMError):
                    raise delta
                if isinstance(delta, BaseException):
                    raise EngineStopped(f"the engine stopped: {delta}")
                done += delta.finish_reason is not None
                yield delta
        finally:
            if done < params.n:
                self.abort(request_id)
            self.release(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (between steps); its queue gets nothing more."""
        self._sinks.pop(request_id, None)
        self._post(("abort", request_id))

    def release(self, request_id: str) -> None:
        """Forget a finished request's queue."""
        self._sinks.pop(request_id, None)

    def _send(self, request_id: str, item) -> None:
        if sink := self._sinks.get(request_id):
            sink[0].call_soon_threadsafe(sink[1].put_nowait, item)

    def _fail_all(self, error: BaseException) -> None:
        """Every waiting stream learns why instead of hanging."""
        for loop, queue in list(self._sinks.values()):
            loop.call_soon_threadsafe(queue.put_nowait, error)

    def _post(self, item) -> None:
        raise NotImplementedError

    def stats(self) -> EngineStats:
        raise NotImplementedError

    def prefill_seconds(self, n: int) -> float:
        """The served model's time to prefill n tokens (prompt compression's break-even)."""
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


class AsyncLLM(EngineFront):
    """Streaming interface: `async for delta in llm.stream(prompt, params)`; `abort(request_id)` from anywhere.

    Requests are tokenized and checked on the caller's thread; the engine thread steps whenever there is work
    and hands each Delta to the asyncio loop of the request's caller."""

    def __init__(self, model, tokenizer=None, *, config: EngineConfig | None = None, dtype=None, device=None,
                 threads: int | None = None, quiet: bool = False, **options):
        """As LLM's: config and its fields as keywords."""
        super().__init__()
        config = engine_config(config, **options)
        self._inbox: list = []  # ("add", seqs) / ("abort", id), applied by the engine thread between steps
        self._wake = threading.Condition()
        # The engine is built on its own thread, so that thread alone ever runs OpenMP work: once the caller's
        # thread has run a parallel region too, the step's kernels ran ~1.7x slower on 2 cores (two thread teams).
        failed: list[BaseException] = []
        ready = threading.Event()

        def build_then_loop():
            try:
                self.engine = _engine(model, tokenizer, dtype, device, threads, config, quiet)
                # a server is ready when it is fast: every compiled graph built before the first request
                self.engine.build_graphs(log=lambda text: quiet or print(f"leanlm: {text}", file=sys.stderr))
            except BaseException as e:
                failed.append(e)
                return
            finally:
                ready.set()
            self._loop()

        self._thread = threading.Thread(target=build_then_loop, name="leanlm-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]
        self.tokenizer, self.limits, self.intake = self.engine.tokenizer, self.engine.limits, self.engine.intake
        self.compiled = self.engine.runner.compiled is not None

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def prefill_seconds(self, n: int) -> float:
        return prefill_seconds(self.engine.model, n)

    def shutdown(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join()

    def _post(self, item) -> None:
        with self._wake:  # checked under the lock the failing engine thread takes: nothing is posted to a dead loop
            if item[0] == "add":
                self._check_running()
            self._inbox.append(item)
            self._wake.notify()

    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    while not (self._inbox or self.engine.has_work or self._stopped):
                        self._wake.wait()
                    if self._stopped:
                        return
                    inbox, self._inbox = self._inbox, []
                for kind, item in inbox:
                    if kind == "abort":
                        self.engine.abort(item)
                        continue
                    try:
                        self.engine.add(item)
                    except LeanLMError as e:  # a duplicate id: that request fails, the others go on
                        self._send(item[0].request_id, e)
                for delta in self.engine.step():
                    self._send(delta.request_id, delta)
        except BaseException as e:
            with self._wake:
                self.error = e
            self._fail_all(e)
            raise
