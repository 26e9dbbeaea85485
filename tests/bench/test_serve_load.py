import json
import sys

import pytest

from leanlm.bench.serve import (LocalServer, RequestResult, _stats, free_port, parse_goodput,
                                summarize)
from leanlm.errors import LeanLMError
from tests.test_cli import leanlm


def test_percentiles_are_nearest_rank_and_goodput_counts_requests_within_every_slo():
    values = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    assert _stats(values) == {"mean": pytest.approx(50.5), "p50": pytest.approx(50), "p90": pytest.approx(90), "p95": pytest.approx(95),
                              "p99": pytest.approx(99)}
    results = [RequestResult(True, 10, output_tokens=11, ttft=0.1 * k, latency=0.1 * k + 0.5) for k in (1, 2, 3)]
    results.append(RequestResult(False, 10, error="HTTP 500"))
    s = summarize(results, 2.0, parse_goodput(["ttft:250", "tpot:50"]))
    assert s["failed"] == 1 and s["request_throughput"] == 1.5 and s["output_throughput"] == 16.5
    assert s["tpot_ms"]["p50"] == pytest.approx(50)  # 0.5 s over 10 tokens after the first
    assert s["goodput"] == 1.0  # ttft 0.1 and 0.2 s are within 250 ms, 0.3 s is not
    with pytest.raises(LeanLMError, match="ttft, tpot or e2el"):
        parse_goodput(["latency:3"])


def test_bench_serve_measures_a_leanlm_server(tiny_dir, tmp_path):
    png = tmp_path / "sweep.png"
    r = leanlm("bench", "serve", tiny_dir, "--num-prompts", "12", "--input-len", "10", "--output-len", "6",
               "--vocab", "120", "--sweep", "1,4", "--plot", png, "--goodput", "ttft:60000", "--json",
               "--serve-args", "--dtype float32 --threads 1 --kv-cache-memory 16MiB")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["max_concurrency"] for row in rows] == [1, 4]
    for row in rows:
        assert row["failed"] == 0 and row["requests"] == 12
        assert row["output_throughput"] == pytest.approx(12 * 6 / row["duration_s"])  # tokens from the usage
        assert row["goodput"] == pytest.approx(row["request_throughput"])
    assert png.stat().st_size > 10_000
    r = leanlm("bench", "serve", "http://127.0.0.1:9", "--num-prompts", "1", "--model-name", "x")
    assert r.returncode == 2 and "warm-up request failed" in r.stderr and "Traceback" not in r.stderr


def test_a_sweep_never_times_a_prompt_the_server_has_cached(tiny_dir):
    """Each level sends its own random prompts, and no timed prompt repeats the warm-up one: a repeat would be
    served from the prefix cache and count as speed (the server's own counter stays at 0 hits)."""
    import httpx

    args = ["--dtype", "float32", "--threads", "1", "--kv-cache-memory", "16MiB"]
    with LocalServer.leanlm(str(tiny_dir), "tiny", args) as server:
        r = leanlm("bench", "serve", server.url, "--num-prompts", "3", "--input-len", "40", "--output-len", "2",
                   "--vocab", "120", "--sweep", "1,2", "--json")
        assert r.returncode == 0, r.stderr
        metrics = httpx.get(f"{server.url}/metrics").text
    counters = {line.split("{")[0].split()[0]: float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("vllm:prefix_cache_")}
    assert counters["vllm:prefix_cache_queries_total"] >= 7 * 40 and counters["vllm:prefix_cache_hits_total"] == 0


def test_bench_serve_sends_a_prompt_file_as_completions_and_chats(tiny_dir, tmp_path):
    """--prompts: text lines go to /v1/completions, message lines to /v1/chat/completions (the server's usage counts
    their tokens: the chat's template makes it longer than its text); a bad file is refused before any server."""
    from leanlm.tokenizer import Tokenizer

    text = "the quick brown fox jumps over the lazy dog"
    runs = {}
    for name, line in (("text", {"prompt": text}), ("chat", {"messages": [{"role": "user", "content": text}]})):
        f = tmp_path / f"{name}.jsonl"
        f.write_text(json.dumps(line) + "\n")
        r = leanlm("bench", "serve", tiny_dir, "--num-prompts", "3", "--output-len", "4", "--prompts", f, "--json",
                   "--max-concurrency", "1", "--serve-args", "--dtype float32 --threads 1 --kv-cache-memory 16MiB")
        assert r.returncode == 0, r.stderr
        runs[name] = json.loads(r.stdout)
        assert runs[name]["failed"] == 0 and runs[name]["output_throughput"] > 0
    tokens = {name: run["total_token_throughput"] * run["duration_s"] - 3 * 4 for name, run in runs.items()}
    assert tokens["text"] == pytest.approx(3 * len(Tokenizer(tiny_dir).encode(text)))
    assert tokens["chat"] > tokens["text"]
    (tmp_path / "bad.jsonl").write_text('{"text": 1}\n')
    r = leanlm("bench", "serve", tiny_dir, "--prompts", tmp_path / "bad.jsonl")
    assert r.returncode == 2 and "line 1" in r.stderr and "Traceback" not in r.stderr


def test_a_server_that_never_answers_is_stopped_and_its_log_tail_reported():
    """LocalServer's start-up timeout: the server is terminated and the error quotes what it printed (its log was
    read after being closed once: a ValueError hid the reason)."""
    cmd = [sys.executable, "-c", "import time; print('compiling bucket 4 of 9', flush=True); time.sleep(60)"]
    server = LocalServer(cmd, free_port(), timeout=3)
    with pytest.raises(LeanLMError, match="did not answer /health within 3 s: compiling bucket 4 of 9"):
        server.__enter__()
    assert server.proc.poll() is not None
