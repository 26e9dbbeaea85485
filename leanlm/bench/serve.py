"""Load generator for any OpenAI-compatible server (leanlm's, vLLM's, llama.cpp's), in the manner of
`vllm bench serve`: random prompts of a set length (sent as token ids, so the server sees exactly that many), a
request rate (Poisson; gamma-distributed gaps with burstiness != 1) or a fixed maximum concurrency, streamed
completions timed per token, and a summary of throughput, latency percentiles and goodput under SLOs.

Two flaws seen in `vllm bench serve` are avoided: output tokens are counted from the server's `usage` whichever
chunk carries it (not by re-tokenizing the text), and a request whose kept-alive connection the server had closed
is retried once on a fresh connection instead of counted as failed."""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import httpx

from leanlm.errors import LeanLMError
from leanlm.runtime import child_env


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0  # seconds to the first chunk with a choice
    latency: float = 0.0  # seconds to the last chunk
    itl: list[float] = field(default_factory=list)  # gaps between chunks with a choice
    error: str = ""

    @property
    def tpot(self) -> float:
        """Time per output token after the first."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def random_prompts(n: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Token ids drawn uniformly, away from the lowest ids (special tokens in most vocabularies)."""
    rng = random.Random(seed)
    return [[rng.randrange(min(1000, vocab // 2), vocab) for _ in range(input_len)] for _ in range(n)]


async def _one(http: httpx.AsyncClient, base_url: str, model: str, prompt, output_len: int, headers: dict,
               retries: int = 1) -> RequestResult:
    """One streamed request: a completion of `prompt` (text or token ids), or a chat reply to it (messages)."""
    chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
    url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    body = {"model": model, "messages" if chat else "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    result = RequestResult(False, len(prompt) if isinstance(prompt, list) else 0)
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with http.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                data = json.loads(line[5:])
                if usage := data.get("usage"):
                    result.output_tokens = usage.get("completion_tokens", result.output_tokens)
                    result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
                if data.get("choices"):  # a token arrived (its text may be empty: part of a character)
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
    except (httpx.RemoteProtocolError, httpx.ConnectError, httpx.ReadError) as e:
        if retries and chunks == 0:  # a kept-alive connection the server had closed: try once more
            return await _one(http, base_url, model, prompt, output_len, headers, retries - 1)
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = last - start
    result.output_tokens = result.output_tokens or chunks  # no usage sent: one token per chunk
    result.ok = chunks > 0
    return result


async def run_load(base_url: str, model: str, prompts: list, output_len: int, rate: float = float("inf"),
                   burstiness: float = 1.0, max_concurrency: int | None = None, api_key: str | None = None,
                   warmup: int = 1, seed: int = 0, progress=None) -> tuple[list[RequestResult], float]:
    """Send the first `warmup` prompts one by one, untimed, then the rest (arrivals at `rate` per second, at most
    `max_concurrency` in flight); (their results, seconds). No timed prompt repeats a warm-up one, whose blocks the
    server's prefix cache would still hold. A prompt is token ids or text (/v1/completions) or chat messages
    (/v1/chat/completions)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    warm, timed = prompts[:warmup], prompts[warmup:]
    limits = httpx.Limits(max_connections=max_concurrency or len(timed) or 1)
    rng = random.Random(seed)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0, connect=30.0)) as http:
        for prompt in warm:
            result = await _one(http, base_url, model, prompt, output_len, headers)
            if not result.ok:
                raise LeanLMError(f"{base_url}: the warm-up request failed ({result.error})")
        gate = asyncio.Semaphore(max_concurrency or len(timed) or 1)

        async def limited(prompt):
            async with gate:
                result = await _one(http, base_url, model, prompt, output_len, headers)
            if progress:
                progress()
            return result

        start, tasks = time.perf_counter(), []
        for prompt in timed:
            tasks.append(asyncio.create_task(limited(prompt)))
            if rate != float("inf"):  # gamma gaps with mean 1/rate; shape 1 is a Poisson process
                await asyncio.sleep(rng.gammavariate(burstiness, 1 / (rate * burstiness)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def _stats(values: list[float]) -> dict:
    """mean, p50, p90, p95, p99 in milliseconds (nearest-rank percentiles)."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p95": 0.0, "p99": 0.0}
    ordered = sorted(values)
    ranks = {f"p{q}": ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)] for q in (50, 90, 95, 99)}
    return {"mean": 1000 * sum(ordered) / len(ordered), **{k: 1000 * v for k, v in ranks.items()}}


def summarize(results: list[RequestResult], seconds: float, goodput: dict[str, float] | None = None) -> dict:
    """Throughputs, latency percentiles (ms) and goodput: requests/s meeting every SLO (ms: ttft, tpot, e2el)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "requests": len(results), "failed": len(results) - len(ok), "duration_s": seconds,
        "request_throughput": len(ok) / seconds, "output_throughput": out_tokens / seconds,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / seconds,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats([r.tpot for r in ok if r.output_tokens > 1]),
        "itl_ms": _stats([gap for r in ok for gap in r.itl]), "e2el_ms": _stats([r.latency for r in ok]),
    }
    if goodput:
        measured = {"ttft": lambda r: r.ttft, "tpot": lambda r: r.tpot, "e2el": lambda r: r.latency}
        good = [r for r in ok if all(1000 * measured[k](r) <= limit for k, limit in goodput.items())]
        summary["goodput"] = len(good) / seconds
        summary["goodput_slo_ms"] = goodput
    return summary


def parse_goodput(items: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:100"] -> {"ttft": 500.0, "tpot": 100.0} (milliseconds)."""
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el"):
            raise LeanLMError(f"--goodput {item!r}: the SLO name must be ttft, tpot or e2el (e.g. ttft:500)")
        try:
            slos[name] = float(value)
        except ValueError:
            raise LeanLMError(f"--goodput {item!r}: give milliseconds after the colon (e.g. tpot:100)") from None
    return slos


def table(rows: list[dict]) -> str:
    """A markdown table of summaries (one row per run, e.g. per concurrency of a sweep)."""
    head = ["concurrency", "rate", "req/s", "output tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "ITL p50 ms",
            "E2E p50 ms", "failed"]
    if any("goodput" in r for r in rows):
        head.append("goodput req/s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r.get("max_concurrency") or "-"), str(r.get("rate", "inf")), f"{r['request_throughput']:.2f}",
                 f"{r['output_throughput']:.1f}", f"{r['ttft_ms']['p50']:.0f} / {r['ttft_ms']['p99']:.0f}",
                 f"{r['tpot_ms']['p50']:.1f} / {r['tpot_ms']['p99']:.1f}", f"{r['itl_ms']['p50']:.1f}",
                 f"{r['e2el_ms']['p50']:.0f}", str(r["failed"])]
        if "goodput" in r:
            cells.append(f"{r['goodput']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_sweep(curves: dict[str, list[dict]], path: str) -> None:
    """Output throughput against median TPOT and TTFT, one line per server, each point a concurrency."""
    import matplotlib  # heavy: only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, rows in curves.items():
        for ax, key in zip(axes, ("tpot_ms", "ttft_ms")):
            ax.plot([r[key]["p50"] for r in rows], [r["output_throughput"] for r in rows], "o-", label=name)
            for r in rows:
                ax.annotate(str(r.get("max_concurrency")), (r[key]["p50"], r["output_throughput"]), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))
    for ax, label in zip(axes, ("median TPOT (ms)", "median TTFT (ms)")):
        ax.set_xlabel(label)
        ax.set_ylabel("output tokens/s")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("throughput vs latency (labels: concurrent requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def to_json(summary: dict) -> str:
    return json.dumps(summary, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def leanlm_command(*args: str) -> list[str]:
    """`leanlm ARGS...` as a subprocess command, run by this Python (no PATH lookup of a `leanlm` script)."""
    return [sys.executable, "-c", "from leanlm.cli import main; main()", *args]


class LocalServer:
    """A server command in its own process on a loopback port, ready once GET `health` answers 200 (its own process:
    the load generator's Python must not share a GIL with the server it measures). A context manager; SIGTERM at
    the end. The server's log goes to a temporary file (a pipe nobody reads would stall a chatty server), whose
    tail explains a failed start."""

    def __init__(self, command: list[str], port: int, env: dict | None = None, timeout: float = 600,
                 health: str = "/health"):
        self.command, self.env, self.timeout = command, env, timeout
        self.url, self.health = f"http://127.0.0.1:{port}", health

    @classmethod
    def leanlm(cls, model: str, name: str, serve_args: list[str], timeout: float = 600,
               env: dict | None = None) -> LocalServer:
        """`leanlm serve MODEL` on a free port, serving it as `name` (env: the server's, default this process's)."""
        port = free_port()
        return cls(leanlm_command("serve", model, "--port", str(port), "--served-model-name", name, *serve_args), port,
                   env=env, timeout=timeout)

    def __enter__(self) -> LocalServer:
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(self.command, env=child_env(self.env), stdout=self.log, stderr=subprocess.STDOUT,
                                     text=True)
        deadline = time.time() + self.timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise LeanLMError(f"{self.command[0]} exited ({self.proc.returncode}): {self.log_tail()}")
            try:
                if httpx.get(self.url + self.health).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        tail = self.log_tail()  # before __exit__ closes the log
        self.__exit__()
        raise LeanLMError(f"{self.command[0]} did not answer {self.health} within {self.timeout:.0f} s: {tail}")

    def log_tail(self, chars: int = 2000) -> str:
        self.log.seek(0)
        return self.log.read()[-chars:]

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def served_model(base_url: str, api_key: str | None = None) -> str:
    """The first model a server lists at /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise LeanLMError(f"{base_url}: cannot list its models ({e}); pass --model-name") from None
