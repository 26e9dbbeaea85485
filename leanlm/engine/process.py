"""EngineProcess: the engine core in a process of its own, as vLLM V1 splits it. The front end (an HTTP server's
event loop) tokenizes and checks requests and streams their Deltas; the core only adds, aborts and steps. With both
in one process, each of an eager step's ~1,800 ops released and retook the GIL, and every bit of front-end Python
that ran meanwhile made the step wait (with a spinning thread beside it, an eager step took 250x as long).

Two pipes carry pickled tuples. To the core: ("add", request_id, prompt ids, SamplingParams), ("abort", id),
("call", id, name, args) and ("stop",). From it: ("ready", Limits, compiled), ("step", deltas, EngineStats),
("refused", request_id, LeanLMError), ("result", id, value, error) and ("failed", error). The front end writes from
one thread and reads on another, which hands each Delta to its request's event loop."""

from __future__ import annotations

import itertools
import multiprocessing
import queue
import signal
import sys
import threading
import traceback
from concurrent.futures import Future
from pathlib import Path

from leanlm.engine.config import EngineConfig, engine_config
from leanlm.engine.engine import Engine, EngineStats
from leanlm.engine.intake import Intake
from leanlm.engine.llm import EngineFront, EngineStopped, _engine
from leanlm.errors import LeanLMError
from leanlm.generation.decode import prefill_seconds
from leanlm.models.zoo import resolve
from leanlm.tokenizer import Tokenizer

CALLS = {"prefill_seconds": lambda engine, n: prefill_seconds(engine.model, n)}  # what the front end may ask


class EngineProcess(EngineFront):
    """AsyncLLM's interface (engine.llm.EngineFront) over an engine in a spawned process. The model is named (a zoo
    name, directory or .gguf file) and loaded there; the tokenizer is loaded in both."""

    def __init__(self, model: str | Path, *, config: EngineConfig | None = None, dtype=None, device=None,
                 threads: int | None = None, quiet: bool = False, **options):
        super().__init__()
        config = engine_config(config, **options)
        if not isinstance(model, (str, Path)) or not (config.draft is None or config.draft_by_name):
            raise LeanLMError("EngineProcess loads its models by name or path in the engine's process: give it "
                              "names, or give AsyncLLM the model objects")
        path = resolve(str(model))  # pulled here, with its progress bar, before the engine's process starts
        self.tokenizer = Tokenizer(path)
        spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: no fork of this one's threads
        core_in, self._to_core = spawn.Pipe(duplex=False)
        self._from_core, core_out = spawn.Pipe(duplex=False)
        self._process = spawn.Process(target=_core, name="leanlm-engine-core", daemon=True,
                                      args=(core_in, core_out, str(path), dtype, device, threads, config, quiet))
        self._process.start()
        core_in.close()
        core_out.close()
        try:
            kind, *ready = self._from_core.recv()
        except EOFError:
            self._process.join(5)
            raise LeanLMError(f"the engine process exited (code {self._process.exitcode}) before it was ready") \
                from None
        if kind != "ready":
            self._process.join(5)
            raise ready[0]
        self.limits, self.compiled = ready
        self.intake = Intake(self.tokenizer, self.limits)
        self._stats = EngineStats(spec_accepted_per_pos=(0,) * config.num_speculative)
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # error and _stopped against _post
        threading.Thread(target=self._write, name="leanlm-to-core", daemon=True).start()
        threading.Thread(target=self._read, name="leanlm-from-core", daemon=True).start()

    def stats(self) -> EngineStats:
        """As of the core's last step."""
        return self._stats

    def prefill_seconds(self, n: int) -> float:
        """Timed in the core between two steps (blocks the calling thread: run it off the event loop)."""
        future = Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        self._post(("call", call_id, "prefill_seconds", (n,)))
        return future.result()

    def shutdown(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._outbox.put(("stop",))
        self._outbox.put(None)
        self._process.join(30)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(5)

    def _post(self, item) -> None:
        with self._lock:
            if item[0] == "abort":
                if self._stopped or self.error is not None:
                    return
            else:
                self._check_running()
            if item[0] == "add":
                seqs = item[1]
                item = ("add", seqs[0].request_id, seqs[0].prompt_ids, seqs[0].params)  # made again in the core
            self._outbox.put(item)

    def _write(self) -> None:
        try:
            while (item := self._outbox.get()) is not None:
                self._to_core.send(item)
        except OSError:  # the core is gone: the reader says why
            pass

    def _read(self) -> None:
        try:
            while True:
                kind, *args = self._from_core.recv()
                if kind == "step":
                    deltas, self._stats = args
                    for delta in deltas:
                        self._send(delta.request_id, delta)
                elif kind == "refused":
                    self._send(*args)
                elif kind == "result":
                    call_id, value, error = args
                    future = self._calls.pop(call_id)
                    if error is not None:
                        future.set_exception(error)
                    else:
                        future.set_result(value)
                else:  # "failed"
                    raise args[0]
        except (EOFError, OSError):
            self._process.join(5)
            error = EngineStopped(f"the engine process exited (code {self._process.exitcode})")
        except BaseException as e:  # what the core sent before it exited
            error = e
        with self._lock:
            if self._stopped:
                return
            self.error = error
        self._fail_all(error)
        for future in list(self._calls.values()):
            future.set_exception(error)


def _core(requests, outputs, model: str, dtype, device, threads, config: EngineConfig, quiet: bool) -> None:
    """The engine process: build the engine (every compiled graph too), report ready, then apply what arrives
    between steps and step while there is work; blocks on the pipe when idle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the front end stops the core
    try:
        engine = _engine(model, None, dtype, device, threads, config, quiet)
        engine.build_graphs(log=lambda text: quiet or print(f"leanlm: {text}", file=sys.stderr))
        outputs.send(("ready", engine.limits, engine.runner.compiled is not None))
        while True:
            idle, applied = not engine.has_work, False
            while idle or requests.poll():
                item = requests.recv()
                if item[0] == "stop":
                    return
                _apply(engine, outputs, *item)
                idle, applied = False, True
            deltas = engine.step()
            if deltas or applied:  # the stats follow an abort too
                outputs.send(("step", deltas, engine.stats()))
    except EOFError:  # the front end is gone
        return
    except BaseException as e:
        traceback.print_exc()
        outputs.send(("failed", e if isinstance(e, LeanLMError) else RuntimeError(f"{type(e).__name__}: {e}")))
        raise SystemExit(1) from None


def _apply(engine: Engine, outputs, kind: str, *args) -> None:
    if kind == "abort":
        engine.abort(*args)
    elif kind == "add":
        request_id, prompt_ids, params = args
        try:
            engine.add(engine.make_request(request_id, prompt_ids, params))
        except LeanLMError as e:  # checked in the front end already; a duplicate id fails that request alone
            outputs.send(("refused", request_id, e))
    else:  # "call"
        call_id, name, call_args = args
        try:
            outputs.send(("result", call_id, CALLS[name](engine, *call_args), None))
        except Exception as e:
            outputs.send(("result", call_id, None, RuntimeError(f"{type(e).__name__}: {e}")))
