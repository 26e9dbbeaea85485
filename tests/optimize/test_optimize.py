"""leanlm optimize: the frontier against its definition, budgets, and a whole sweep on a tiny model (resumed)."""

from __future__ import annotations

import json
import math
import random
import shlex
import shutil
import subprocess

import pytest

from leanlm.errors import LeanLMError
from leanlm.optimize.pareto import Budget, frontier, recommend
from leanlm.optimize.plan import parse_slo
from leanlm.optimize.served import serve_args
from leanlm.optimize.variants import Variant, read_variants


def dominated(p, q) -> bool:
    """q dominates p: no worse in both coordinates, better in one."""
    return q[0] <= p[0] and q[1] <= p[1] and q != p


@pytest.mark.parametrize("seed", range(20))
def test_frontier_is_exactly_the_non_dominated_points(seed):
    rng = random.Random(seed)
    points = [(rng.randint(0, 6), rng.randint(0, 6)) for _ in range(rng.randint(1, 25))]  # many ties
    expected = {i for i, p in enumerate(points) if not any(dominated(p, q) for q in points)}
    front = frontier(points)
    assert set(front) == expected and len(front) == len(set(front))
    assert [points[i][0] for i in front] == sorted(points[i][0] for i in front)


def test_budget_parses_terms_and_names_what_a_row_breaks():
    b = Budget.parse("latency_ms=10, ppl_gap=0.02,memory_mb=200")
    assert (b.latency_ms, b.ppl_gap, b.memory_mb, b.kl) == (10, 0.02, 200, None) and b.bounds_quality
    assert Budget.parse("") == Budget() and not Budget.parse("memory_mb=1").bounds_quality
    row = dict(tpot_ms=12.0, memory_mb=150.0, ppl_gap=0.01, kl=0.1, ttft_ms=50.0)
    assert b.breaks(row) == ["latency_ms 12 > 10"]
    assert Budget.parse("pass1=0.5").breaks(row) == ["pass1 not measured < 0.5"]
    assert Budget.parse("rps=2").breaks({**row, "rps": 1.5}) == ["rps 1.5 < 2"] and not Budget(rps=1).breaks({"rps": 1})
    for bad, message in (("speed=3", "one of"), ("kl", "NAME=VALUE"), ("kl=abc", "not a number"), ("kl=-1", "negative")):
        with pytest.raises(LeanLMError, match=message):
            Budget.parse(bad)


@pytest.mark.parametrize("seed", range(30))
def test_the_recommendation_fits_the_budget_and_is_the_best_that_does(seed):
    rng = random.Random(seed)
    rows = [dict(tpot_ms=rng.uniform(5, 20), ttft_ms=rng.uniform(50, 200), memory_mb=rng.uniform(50, 300),
                 ppl_gap=rng.uniform(0, 0.1), kl=rng.uniform(0, 0.2), rps=rng.uniform(0, 4)) for _ in range(8)]
    budget = Budget(latency_ms=rng.choice([None, 12.0]), memory_mb=rng.choice([None, 150.0]),
                    ppl_gap=rng.choice([None, 0.03]), rps=rng.choice([None, 1.5]))
    fits = [i for i, r in enumerate(rows) if not budget.breaks(r)]
    best = recommend(rows, budget)
    if not fits:
        assert best is None
        return
    assert best in fits
    if budget.bounds_quality:  # the most requests/s within the SLO
        assert rows[best]["rps"] == max(rows[i]["rps"] for i in fits)
    else:  # the most faithful
        assert rows[best]["kl"] == min(rows[i]["kl"] for i in fits)


def test_variants_come_from_yaml_with_clear_errors(tmp_path):
    assert len(read_variants("quick")) < len(read_variants("default"))
    f = tmp_path / "v.yaml"
    f.write_text("- {name: a}\n- name: b\n  steps: [{method: rtn, bits: 8}]\n  kv_cache: int8\n  prompt_lookup: 3\n")
    a, b = read_variants(f)
    assert not a.builds_model and b.steps == ({"method": "rtn", "bits": 8},) and b.kv_cache == "int8"
    assert not b.prunes and Variant("p", ({"method": "wanda", "pattern": "2:4"},)).prunes
    for text, message in (("- {name: a}\n- {name: a}", "unique"), ("- {name: a, colour: red}", "unknown keys"),
                          ("[1, 2]", "list of variants"), ("- {name: a, kv_cache: 4}", "kv_cache"),
                          ("- {name: a, kv_cache: 16}", "use auto"),
                          ("- {name: a, steps: [{method: nope}]}", "nope")):
        f.write_text(text)
        with pytest.raises(LeanLMError, match=message):
            read_variants(f)
    with pytest.raises(LeanLMError, match="not a file"):
        read_variants(tmp_path / "missing.yaml")


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A whole sweep of a tiny model: the original, int8 weights, int8 weights + int8 KV cache + prompt lookup."""
    from tests.conftest import make_hf_model, make_tokenizer

    from leanlm.optimize.job import optimize
    from leanlm.optimize.sweep import Settings

    model = tmp_path_factory.mktemp("model")
    make_hf_model("llama", model, max_position_embeddings=1024)  # prompt lookup's grounded prompts are ~600 tokens
    make_tokenizer(model)
    cache, out = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("out") / "run"
    variants = (Variant("f32", dtype="float32"), Variant("w8", ({"method": "rtn", "bits": 8},), dtype="float32"),
                Variant("w8 kv8 lookup", ({"method": "rtn", "bits": 8},), dtype="float32", kv_cache="int8",
                        prompt_lookup=2))
    settings = Settings(reference_dtype="float32", eval_tokens=600, samples=2, seq_len=64, prompt_tokens=16,
                        new_tokens=8, levels=(1, 2), requests=3, compiled=False, threads=1)
    args = (str(model), variants, Budget.parse("ppl_gap=0.5"), settings, out, parse_slo("p95_e2e=60s"))
    return optimize(*args, cache_root=cache, mixed=True, rps=1000, cache_hit=0.2), args, cache


def test_a_sweep_measures_every_variant_and_writes_its_outputs(swept):
    import matplotlib.image

    outcome, (model, variants, budget, settings, out, _), _ = swept
    rows = outcome.rows
    assert [r["name"] for r in rows] == [v.name for v in variants] + ["w4 rtn g32+head8", "mixed 4/8 rtn+head8"]
    base, w8, kv8, w4, mixed = rows
    assert mixed["memory_mb"] <= w4["memory_mb"] and "knapsack" in mixed["variant"]["notes"]
    assert (out / "sensitivity.png").exists() and 'src="sensitivity.png"' in (out / "report.html").read_text()
    rows = rows[:3]
    assert base["kl"] == 0 and base["ppl_gap"] == 0 and base["top1"] == 1 and base["build_s"] == 0
    assert w8["kl"] > 0 and w8["memory_mb"] < base["memory_mb"] and w8["bits_per_weight"] < 32
    assert kv8["kl"] != w8["kl"]  # the int8 cache changes what attention sees
    for r in rows:  # served at concurrency 1 and 2, 3 requests each; the SLO is loose: the faster level's rate
        assert [(c["max_concurrency"], c["requests"], c["failed"]) for c in r["curve"]] == [(1, 3, 0), (2, 4, 0)]
        fastest = max(r["curve"], key=lambda c: c["request_throughput"])
        assert r["rps"] == fastest["request_throughput"] > 0 and r["rps_at"] == f"concurrency {fastest['max_concurrency']}"
        assert r["throughput"] == r["curve"][1]["output_throughput"] and r["peak_memory_mb"] > 0
        assert r["tpot_ms"] == r["curve"][0]["tpot_ms"]["p50"] > 0 and r["ttft_ms"] > 0 and 0 < r["mbu"] < 1
        assert len(r["dp"]) == 7
    assert outcome.best is not None and not outcome.best["over_budget"]
    assert outcome.best["rps"] == max(r["rps"] for r in outcome.rows if not r["over_budget"])
    # the command the variant was timed with: eager (compiled=False), its flags, the threads
    assert outcome.serve_command == shlex.join(["leanlm", "serve", str(out / "recommended"),
                                                *serve_args(outcome.best["variant"], False, 1)])
    assert outcome.serve_command.endswith("--threads 1") and "--compile" not in outcome.serve_command
    assert (out / "recommended" / "config.json").exists()
    # capacity for 1000 req/s with 20% cache hits, per frontier variant: leanlm plan's arithmetic on its curve
    frontier = {r["name"] for r in outcome.rows if r["on_frontier"]}
    assert set(outcome.capacity) == frontier
    for r in outcome.rows:
        if r["name"] in frontier:
            assert r["replicas"] == math.ceil(800 / r["rps"]) > 1
            assert f"replicas: ceil(800 / {r['rps']:.4g}) = {r['replicas']}" in outcome.capacity[r["name"]]
    saved = json.loads((out / "results.json").read_text())
    assert saved["recommended"] == outcome.recommended and len(saved["rows"]) == 5
    assert all(r["on_frontier"] for r in rows if r is outcome.best)
    page = (out / "report.html").read_text()
    assert all(r["name"] in page for r in rows) and "<script>" in page and "http" not in page.split("<script>")[1]
    image = matplotlib.image.imread(out / "pareto.png")
    assert image.shape[0] > 300 and image.shape[1] > 600 and image.std() > 0.01


def test_a_repeated_sweep_measures_nothing_twice(swept, monkeypatch):
    from leanlm.optimize import sweep
    from leanlm.optimize.job import optimize

    outcome, args, cache = swept

    def fail(*_, **__):
        raise AssertionError("measured twice")

    from leanlm.optimize import sensitivity

    for name in ("build", "quality", "cost"):
        monkeypatch.setattr(sweep.Sweep, name, fail)
    monkeypatch.setattr(sensitivity, "layer_sensitivity", fail)
    again = optimize(*args, cache_root=cache, mixed=True, rps=1000, cache_hit=0.2)
    assert again.rows == outcome.rows


def test_a_report_opens_in_a_headless_browser(swept, tmp_path):
    """The page draws both plots and the table with no script error (Chromium, when installed)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    outcome = swept[0]
    page = outcome.output / "report.html"
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1300,1000",
             f"--user-data-dir={tmp_path / 'profile'}"]
    shot = tmp_path / "shot.png"
    subprocess.run([*flags, f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120, check=True)
    dom = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    assert 'data-errors=""' in dom and 'data-drawn="1"' in dom
    drawn = dom.split("<script>")[0]  # the page as the script left it, without the script's own text
    assert drawn.count("<svg") == 3 and drawn.count("<tr") == len(outcome.rows) + 1
    assert drawn.count('class="rec"') == 3  # the recommendation ringed in every plot
    assert shot.stat().st_size > 10_000


def test_optimize_cli_refuses_bad_input(tmp_path):
    from typer.testing import CliRunner

    from leanlm.cli.common import app

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "file").write_text("x")
    runner = CliRunner()
    for args, message in ((["--budget", "speed=1"], "one of"), (["--recipes", str(tmp_path / "no.yaml")], "not a file"),
                          (["-o", str(tmp_path / "other")], "not an optimize output")):
        result = runner.invoke(app, ["optimize", "x", *args])
        assert result.exit_code != 0 and message in str(result.exception) + result.output


def test_a_sweep_fans_out_over_a_local_ray_instance(swept, tmp_path):
    """The same variants as Ray tasks (a local instance on loopback) give the same quality rows, cached alike."""
    pytest.importorskip("ray")
    import ray

    from leanlm.optimize.sweep import Sweep

    outcome, (model, variants, budget, settings, out, _), _ = swept
    sweep = Sweep(model, variants[:2], settings, tmp_path)
    try:
        rows = sweep.run(ray_address="local")
    finally:
        ray.shutdown()
    for ours, theirs in zip(rows, outcome.rows):
        assert ours.name == theirs["name"] and ours.perplexity == pytest.approx(theirs["perplexity"], rel=1e-5)
        assert ours.kl == pytest.approx(theirs["kl"], rel=1e-3, abs=1e-9)  # another thread count: other roundings
        assert ours.tpot_ms > 0
    assert len(list((sweep.root / "rows").glob("*.json"))) == 2


@pytest.mark.parametrize("change", ["leanlm", "commit", "torch", "cpu", "isa", "kernels"])
def test_a_changed_environment_measures_again(swept, monkeypatch, change):
    """Every input of the cache's environment key (leanlm's version and commit, torch, the CPU model and ISA flags,
    the kernels' sources) names another folder: after an upgrade no cached row comes back as measured."""
    from leanlm.optimize import sweep as module

    _, (model, variants, _, settings, _, _), cache = swept
    before = module.Sweep(model, variants[:1], settings, cache)
    assert before._row_path(variants[0]).exists()  # the fixture's sweep measured it
    patches = {"leanlm": ("version", lambda name: "99.0"),
               "commit": ("subprocess", type("git", (), {"run": staticmethod(
                   lambda *a, **k: subprocess.CompletedProcess(a, 0, "f" * 40, ""))})),
               "torch": ("torch", type("torch", (), {"__version__": "99.0"})),
               "cpu": ("device_name", lambda device: "another CPU (2 cpus)"),
               "isa": ("kernels", type("kernels", (), {"cpu_flags": staticmethod(lambda: ["avx2"]),
                                                       "source_hash": staticmethod(module.kernels.source_hash)})),
               "kernels": ("kernels", type("kernels", (), {"cpu_flags": staticmethod(module.kernels.cpu_flags),
                                                           "source_hash": staticmethod(lambda: "00000000")}))}
    name, value = patches[change]
    monkeypatch.setattr(module, name, value)
    after = module.Sweep(model, variants[:1], settings, cache)
    assert module.environment()[change] != json.loads((before.root / "environment.json").read_text())[change]
    assert after.root != before.root and not after._row_path(variants[0]).exists()


def test_optimize_cli_prints_the_table_and_the_serve_command(tmp_path):
    import os
    import sys

    from tests.conftest import make_hf_model, make_tokenizer

    from leanlm.fetch import cache_dir

    model = tmp_path / "model"
    make_hf_model("llama", model)
    make_tokenizer(model)
    cache = tmp_path / "cache"
    cache.mkdir()
    if (cache_dir() / "probe.json").exists():  # the machine's peaks, measured once already: no second probe
        shutil.copy(cache_dir() / "probe.json", cache / "probe.json")
    (tmp_path / "v.yaml").write_text("- {name: f32, dtype: float32}\n")
    cmd = [sys.executable, "-m", "leanlm.cli", "optimize", str(model), "--recipes", str(tmp_path / "v.yaml"), "--eager",
           "--eval-tokens", "300", "--levels", "1", "--threads", "1", "--budget", "memory_mb=100",
           "-o", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "LEANLM_CACHE": str(cache)},
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    command = f"leanlm serve {tmp_path / 'out' / 'recommended'} --dtype float32 --threads 1"  # --eager: no --compile
    assert "f32 *" in proc.stdout and command in proc.stdout
    assert json.loads((tmp_path / "out" / "results.json").read_text())["recommended"] == 0
    assert "f32: quality" in proc.stderr and "f32: serving it" in proc.stderr  # a log sees each step (not a terminal)


def test_serve_commands_follow_the_variant_and_drafts_come_from_the_zoo():
    from pathlib import Path

    from leanlm.optimize.served import serve_command
    from leanlm.optimize.variants import draft_variants

    variant = Variant("v", dtype="float16", kv_cache="int8", prompt_lookup=3).to_dict()
    # compiled, but the engine runs an int8 KV cache's steps eager: no --compile
    assert serve_command(variant, Path("d"), True) == "leanlm serve d --dtype float16 --kv-cache int8 --prompt-lookup 3"
    draft = draft_variants("qwen2.5-coder-1.5b")
    assert draft and all(v.draft == "qwen2.5-coder-0.5b" for v in draft) and draft_variants("smollm2-135m") == ()
    assert (serve_command(draft[0].to_dict(), Path("d"), True, 2)
            == "leanlm serve d --compile --draft qwen2.5-coder-0.5b --threads 2")
    assert serve_command(draft[0].to_dict(), Path("d"), False) == "leanlm serve d --draft qwen2.5-coder-0.5b"
    with pytest.raises(LeanLMError, match="not both"):
        Variant("x", draft="a", prompt_lookup=2)


def test_a_draft_variant_is_timed_as_served(tiny_dir):
    """A speculative variant's cost is its server's, speculating with the draft (here the model drafting for itself),
    on passages of the evaluation text: no speedup measured elsewhere divides its TPOT."""
    from leanlm.bench.workload import passage_prompts
    from leanlm.optimize.served import measure_served, serve_args
    from leanlm.tokenizer import Tokenizer

    variant = Variant("draft", dtype="float32", draft=str(tiny_dir)).to_dict()
    prompts = passage_prompts(Tokenizer(tiny_dir), 4, 16)
    r = measure_served(tiny_dir, serve_args(variant, False, 1), prompts, (1, 3), 2, 6)
    assert [c["max_concurrency"] for c in r["curve"]] == [1, 3] and r["curve"][1]["requests"] == 6
    assert all(c["failed"] == 0 for c in r["curve"]) and r["tpot_ms"] > 0 and r["prompt_tokens"] > 10


def test_a_variant_that_fails_is_reported_and_the_others_go_on(tmp_path):
    from tests.conftest import make_hf_model, make_tokenizer

    from leanlm.optimize.job import optimize
    from leanlm.optimize.sweep import Settings

    make_hf_model("llama", tmp_path / "m")
    make_tokenizer(tmp_path / "m")
    variants = (Variant("f32", dtype="float32"),  # 7 layers asked of a model of 2: the prune step fails
                Variant("cut", ({"method": "layers", "num_layers": 7},), dtype="float32"))
    settings = Settings(reference_dtype="float32", eval_tokens=300, samples=2, seq_len=32, prompt_tokens=8,
                        new_tokens=4, levels=(1,), requests=2, compiled=False, threads=1)
    outcome = optimize(str(tmp_path / "m"), variants, Budget(), settings, tmp_path / "out", parse_slo("p95_e2e=60s"),
                       cache_root=tmp_path / "c")
    assert [r["name"] for r in outcome.rows] == ["f32"] and list(outcome.failed) == ["cut"]
    assert "building variant cut failed" in outcome.failed["cut"]
    assert "not measured: cut" in (tmp_path / "out" / "report.html").read_text()


def test_a_variant_that_serves_less_than_the_original_is_flagged():
    from leanlm.optimize.job import _slower_than_original

    def row(name, throughput, rps, **variant):
        return {"name": name, "throughput": throughput, "rps": rps, "variant": Variant(name, **variant).to_dict()}

    rows = [row("w8", 290, 2.8, steps=({"method": "rtn", "bits": 8},)), row("bf16", 207, 1.6),
            row("lookup", 169, 2.0, prompt_lookup=3), row("fp16", 49, 0.4, dtype="float16")]
    notes = _slower_than_original(rows, 16)
    assert notes == ["lookup serves less than bf16 under load: 169 against 207 output tokens/s at concurrency 16, "
                     "2.00 against 1.60 requests/s within the SLO",
                     "fp16 serves less than bf16 under load: 49 against 207 output tokens/s at concurrency 16, "
                     "0.40 against 1.60 requests/s within the SLO"]
    assert _slower_than_original(rows[2:], 16) == []  # no unchanged bf16 row: nothing to compare with
