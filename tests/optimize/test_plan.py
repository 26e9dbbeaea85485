"""Capacity planning: SLO parsing, the point chosen from a measured curve, the replica arithmetic, the CLI."""

import json

import pytest

from leanlm.bench.serve import RequestResult, summarize, to_json
from leanlm.errors import LeanLMError
from leanlm.optimize.plan import SloTerm, parse_slo, plan, read_curve, replicas_needed
from tests.test_cli import leanlm


def bench_row(concurrency: int, e2e_s: list[float], seconds: float, failed: int = 0) -> dict:
    """One point as `leanlm bench serve --json` writes it: the bench's own summary plus the keys its verb adds."""
    results = [RequestResult(True, 16, output_tokens=9, ttft=0.1 * t, latency=t, itl=[0.9 * t / 8] * 8)
               for t in e2e_s]
    results += [RequestResult(False, 16, error="HTTP 503")] * failed
    row = {**summarize(results, seconds), "max_concurrency": concurrency, "rate": float("inf"), "input_len": 16,
           "output_len": 9, "model": "tiny", "url": "http://127.0.0.1:1"}
    return json.loads(to_json(row))  # through the bench's serialisation, as a file would hold it


def curve() -> list[dict]:
    """20 requests per level: 1 req/s at 1 s, 3 req/s at 2.5 s, 5 req/s at 6 s (p99 e2e)."""
    return [bench_row(1, [1.0] * 20, 20.0), bench_row(4, [2.0] * 19 + [2.5], 20 / 3),
            bench_row(16, [5.0] * 19 + [6.0], 4.0)]


def test_the_lectures_example_needs_800_replicas():
    p = plan(1000, parse_slo("p95_e2e=3s"), per_replica_rps=1, cache_hit=0.2)
    assert (p.load_rps, p.replicas) == (800, 800)
    assert replicas_needed(0.7 * 100, 1) == 70  # 70.00000000000001 in floats, not 71 replicas
    assert replicas_needed(0.001, 5) == 1


def test_slo_parsing():
    assert parse_slo("p95_e2e=3s, p99_ttft=500ms,mean_tpot=40ms,p90_e2el=2.5s") == [
        SloTerm("p95", "e2e", 3000), SloTerm("p99", "ttft", 500), SloTerm("mean", "tpot", 40),
        SloTerm("p90", "e2e", 2500)]
    for bad, message in [("p95_latency=3s", "ttft, tpot, itl, e2e"), ("p95_e2e=3", "STAT_METRIC=VALUEUNIT"),
                         ("p95_e2e=3min", "STAT_METRIC=VALUEUNIT"), ("e2e=3s", "STAT_METRIC=VALUEUNIT"),
                         ("p100_e2e=1s", "between p0 and p100"), ("p95_e2e=0s", "above zero"), (" , ", "empty")]:
        with pytest.raises(LeanLMError, match=message):
            parse_slo(bad)


def test_the_best_point_meeting_every_term_is_chosen_and_a_breaking_one_never():
    p = plan(30, parse_slo("p99_e2e=3s"), curve())
    assert [pt.meets for pt in p.points] == [True, True, False]  # 16 concurrent: 5 req/s, but p99 6 s
    assert p.chosen == 1 and p.per_replica_rps == pytest.approx(3) and p.replicas == 10
    assert not any("sweep higher" in n for n in p.notes)  # a higher load was measured (and missed)
    p = plan(30, parse_slo("p99_e2e=3s,p99_ttft=150ms"), curve())  # ttft is a tenth of e2e: 250 ms at 4
    assert p.chosen == 0 and p.replicas == 30
    p = plan(30, parse_slo("p99_e2e=10s"), curve())  # every point meets: the highest load, with a caveat
    assert p.chosen == 2 and p.replicas == 6 and any("sweep higher" in n for n in p.notes)
    p = plan(30, parse_slo("p99_e2e=3s"), curve(), headroom=0.25)  # 3 x 0.75 = 2.25 per replica
    assert p.usable_rps == pytest.approx(2.25) and p.replicas == 14


def test_failed_requests_and_unreported_percentiles_are_judged_conservatively():
    rows = curve()
    rows[1] = bench_row(4, [2.0] * 19, 20 / 3, failed=1)
    p = plan(30, parse_slo("p99_e2e=3s"), rows)
    assert p.chosen == 0 and "1 of 20 requests failed" in p.points[1].why_not()
    # the bench reports p50/p90/p95/p99: p97 is read as p99, its upper bound (p95 1 s meets 3 s, p99 4 s does not)
    rows = [bench_row(1, [1.0] * 98 + [4.0] * 2, 20.0)]
    assert rows[0]["e2el_ms"]["p95"] == pytest.approx(1000) and "p97" not in rows[0]["e2el_ms"]
    assert plan(1, parse_slo("p95_e2e=3s"), rows).chosen == 0
    with pytest.raises(LeanLMError, match="no measured point meets"):
        plan(1, parse_slo("p97_e2e=3s"), rows)
    p = plan(1, parse_slo("p97_e2e=5s"), rows)
    assert p.points[0].checks[0].used == "p99" and any("does not report p97" in n for n in p.notes)
    with pytest.raises(LeanLMError, match="above every percentile"):
        plan(1, parse_slo("p99.9_e2e=5s"), rows)


def test_no_point_meeting_the_slo_is_one_clear_error():
    with pytest.raises(LeanLMError, match=r"no measured point meets the SLO \(concurrency 1: p99 e2e 1 s > 500 ms;"):
        plan(30, parse_slo("p99_e2e=500ms"), curve())


def test_inputs_and_files_are_checked(tmp_path):
    for kwargs, message in [(dict(rps=0), "--rps"), (dict(cache_hit=1.0), "--cache-hit"),
                            (dict(headroom=-0.1), "--headroom")]:
        with pytest.raises(LeanLMError, match=message):
            plan(**{"rps": 10, "slo": [], "per_replica_rps": 1, **kwargs})
    with pytest.raises(LeanLMError, match="either"):
        plan(10, [], curve(), per_replica_rps=1)
    one = tmp_path / "one.json"
    one.write_text(json.dumps(curve()[0]))  # without --sweep the bench writes one object
    assert len(read_curve(one)) == 1
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps([{"request_throughput": 1}]))
    for name, message in [("missing.json", "does not exist"), ("bad.json", "is not JSON"),
                          ("other.json", "not `leanlm bench serve --json` output")]:
        with pytest.raises(LeanLMError, match=message):
            read_curve(tmp_path / name)


def test_cli_plans_from_a_bench_file_and_fails_in_one_line(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(curve()))
    r = leanlm("plan", "--rps", 36, "--cache-hit", 0.25, "--slo", "p99_e2e=3s", "--from", bench)
    assert r.returncode == 0, r.stderr
    assert "-> concurrency 4" in r.stdout and "replicas: ceil(27 / 3) = 9" in r.stdout
    r = leanlm("plan", "--rps", 36, "--cache-hit", 0.25, "--slo", "p99_e2e=3s", "--from", bench, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["replicas"] == 9 and out["chosen"] == 1 and [p["meets"] for p in out["points"]] == [True, True, False]
    r = leanlm("plan", "--rps", 1000, "--cache-hit", 0.2, "--per-replica-rps", 1)
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "replicas: ceil(800 / 1) = 800"
    for args, message in [(["--slo", "p95_e2e=3", "--from", bench], "STAT_METRIC=VALUEUNIT"),
                          (["--slo", "p95_e2e=3s", "--from", tmp_path / "no.json"], "does not exist"),
                          (["--from", bench], "--from needs --slo"), ([], "one of the two"),
                          (["--per-replica-rps", 1, "--cache-hit", 1], "--cache-hit")]:
        r = leanlm("plan", "--rps", 10, *args)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
