"""Capacity planning: how many replicas serve a request rate within a latency SLO, from a measured
throughput/latency curve (`leanlm bench serve --sweep ... --json`).

The arithmetic is the lectures' capacity example: replicas = ceil(rps × (1 − cache_hit) / per-replica rps), where
the per-replica rate is the highest request throughput one served replica was *measured* to sustain while every
SLO term held (1000 RPS, 20% cache hits, 1 RPS per accelerator at p95 < 3 s -> 800 accelerators).

Only measured points are used: no interpolation between sweep points (latency percentiles rise steeply and
non-linearly as a replica nears saturation, so a value between two points is a guess; sweep finer instead) and
never beyond the highest load measured."""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from leanlm.errors import LeanLMError

# SLO metric -> the key of its statistics in a `leanlm bench serve` summary (milliseconds).
METRICS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "itl": "itl_ms", "e2e": "e2el_ms"}
_ALIASES = {"e2el": "e2e"}  # the bench's own name for end-to-end latency
_UNITS = {"ms": 1.0, "s": 1000.0}
_TERM = re.compile(r"^(?:p(?P<q>\d+(?:\.\d+)?)|(?P<mean>mean))_(?P<metric>[a-z0-9]+)=(?P<value>\d+(?:\.\d*)?|\.\d+)"
                   r"(?P<unit>ms|s)$")
BENCH_HINT = "write one with `leanlm bench serve MODEL --sweep 1,2,4,8,16 --json > BENCH.json`"


@dataclass(frozen=True)
class SloTerm:
    """One SLO term: a statistic (`p95`, `mean`) of a latency metric (ttft, tpot, itl, e2e) at most `limit_ms`."""

    stat: str
    metric: str
    limit_ms: float

    def __str__(self) -> str:
        return f"{self.stat} {self.metric} <= {_ms(self.limit_ms)}"


@dataclass
class Check:
    """One SLO term against one measured point: `used` is the statistic read (an upper bound when the bench did
    not report the one asked for)."""

    term: SloTerm
    used: str
    value_ms: float
    ok: bool

    @property
    def name(self) -> str:
        """"p99 e2e", or "p99 (for p95) e2e" when the one asked for was not reported."""
        used = self.used if self.used == self.term.stat else f"{self.used} (for {self.term.stat})"
        return f"{used} {self.term.metric}"


@dataclass
class Point:
    """One measured load level of the curve and whether it meets every SLO term."""

    label: str  # "concurrency 4", "rate 2.0/s", "unbounded"
    load: float  # the concurrency or arrival rate it was measured at (inf: all requests at once)
    request_throughput: float  # requests/s completed
    requests: int
    failed: int
    checks: list[Check]

    @property
    def meets(self) -> bool:
        return self.failed == 0 and all(c.ok for c in self.checks)

    def why_not(self) -> str:
        reasons = [f"{self.failed} of {self.requests} requests failed"] if self.failed else []
        reasons += [f"{c.name} {_ms(c.value_ms)} > {_ms(c.term.limit_ms)}" for c in self.checks
                    if not c.ok]
        return "; ".join(reasons)


@dataclass
class Plan:
    """The inputs, the chosen point and the arithmetic, so that the answer can be shown step by step."""

    rps: float
    cache_hit: float
    headroom: float
    slo: list[SloTerm]
    per_replica_rps: float  # measured (the chosen point's request throughput) or given
    source: str  # the bench file, or "given"
    points: list[Point] = field(default_factory=list)  # every measured point, in the file's order
    chosen: int | None = None  # index into points
    load_rps: float = 0.0  # rps × (1 − cache_hit): what reaches the model
    usable_rps: float = 0.0  # per_replica_rps × (1 − headroom): what each replica is planned to carry
    replicas: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["slo"] = [str(t) for t in self.slo]
        for p, point in zip(d["points"], self.points):
            p["meets"] = point.meets
            p["load"] = None if math.isinf(point.load) else point.load  # strict JSON has no Infinity
            for c in p["checks"]:
                c["term"] = str(SloTerm(**c["term"]))
        return d


def _ms(value_ms: float) -> str:
    return f"{value_ms / 1000:.3g} s" if value_ms >= 1000 else f"{value_ms:.3g} ms"


def parse_slo(text: str) -> list[SloTerm]:
    """"p95_e2e=3s,p99_ttft=500ms" -> SloTerms (statistic: pNN or mean; metric: ttft, tpot, itl, e2e; unit: s, ms)."""
    terms = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        m = _TERM.match(item)
        if not m:
            raise LeanLMError(f"--slo {item!r}: write STAT_METRIC=VALUEUNIT, e.g. p95_e2e=3s or p99_ttft=500ms "
                              "(STAT: pNN or mean; UNIT: s or ms)")
        metric = _ALIASES.get(m["metric"], m["metric"])
        if metric not in METRICS:
            raise LeanLMError(f"--slo {item!r}: the metric must be one of {', '.join(METRICS)}")
        q = m["q"]
        if q is not None and not 0 < float(q) < 100:
            raise LeanLMError(f"--slo {item!r}: a percentile lies between p0 and p100")
        limit = float(m["value"]) * _UNITS[m["unit"]]
        if limit <= 0:
            raise LeanLMError(f"--slo {item!r}: the limit must be above zero")
        terms.append(SloTerm("mean" if m["mean"] else f"p{q}", metric, limit))
    if not terms:
        raise LeanLMError("--slo is empty: give at least one term, e.g. p95_e2e=3s")
    return terms


def _statistic(stats: dict, stat: str) -> str:
    """The key to read for `stat`: itself when reported, else the nearest reported percentile above it (an upper
    bound: if it meets the limit, so does the one asked for)."""
    if stat in stats:
        return stat
    if stat == "mean":
        raise LeanLMError("the bench file reports no mean")
    asked = float(stat[1:])
    above = sorted((float(k[1:]), k) for k in stats if k.startswith("p") and float(k[1:]) > asked)
    if not above:
        reported = ", ".join(k for k in stats if k.startswith("p"))
        raise LeanLMError(f"{stat} is above every percentile the bench reports ({reported}); use one of those")
    return above[0][1]


def check_point(row: dict, slo: list[SloTerm]) -> Point:
    """One summary row of `leanlm bench serve --json` checked against every SLO term."""
    checks = []
    for term in slo:
        stats = row[METRICS[term.metric]]
        used = _statistic(stats, term.stat)
        checks.append(Check(term, used, float(stats[used]), float(stats[used]) <= term.limit_ms))
    if row.get("max_concurrency"):
        label, load = f"concurrency {row['max_concurrency']}", float(row["max_concurrency"])
    elif row.get("rate") not in (None, "inf", float("inf")):
        label, load = f"rate {row['rate']}/s", float(row["rate"])
    else:
        label, load = "unbounded", float("inf")
    return Point(label, load, float(row["request_throughput"]), int(row["requests"]), int(row["failed"]), checks)


def read_curve(path: str | Path) -> list[dict]:
    """The summary rows of a `leanlm bench serve --json` file (a list with --sweep, one object without)."""
    path = Path(path)
    if not path.is_file():
        raise LeanLMError(f"{path} does not exist; {BENCH_HINT}")
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise LeanLMError(f"{path} is not JSON ({e}); {BENCH_HINT}") from None
    rows = data if isinstance(data, list) else [data]
    needed = ("request_throughput", "requests", "failed", *METRICS.values())
    for row in rows:
        if not isinstance(row, dict) or any(k not in row for k in needed) or not all(
                isinstance(row[k], dict) for k in METRICS.values()):
            raise LeanLMError(f"{path} is not `leanlm bench serve --json` output (each point needs "
                              f"{', '.join(needed)}); {BENCH_HINT}")
    if not rows:
        raise LeanLMError(f"{path} holds no measured points; {BENCH_HINT}")
    return rows


def best_point(points: list[Point]) -> int:
    """The index of the highest-throughput point that meets every term; LeanLMError naming each miss if none."""
    meeting = [i for i, p in enumerate(points) if p.meets]
    if not meeting:
        misses = "; ".join(f"{p.label}: {p.why_not()}" for p in points)
        raise LeanLMError(f"no measured point meets the SLO ({misses}); a replica as benchmarked cannot meet it at "
                          "any load measured: loosen the SLO, serve a faster variant, or measure lower loads")
    return max(meeting, key=lambda i: points[i].request_throughput)


def replicas_needed(load_rps: float, usable_rps: float) -> int:
    """ceil(load / per-replica), at least one; rounded to 9 digits first so 70.00000000000001 is 70, not 71."""
    return max(1, math.ceil(round(load_rps / usable_rps, 9)))


def _check_inputs(rps: float, cache_hit: float, headroom: float) -> None:
    if not rps > 0:
        raise LeanLMError(f"--rps must be above zero (got {rps})")
    if not 0 <= cache_hit < 1:
        raise LeanLMError(f"--cache-hit is a fraction in [0, 1) (got {cache_hit})")
    if not 0 <= headroom < 1:
        raise LeanLMError(f"--headroom is a fraction in [0, 1) (got {headroom})")


def plan(rps: float, slo: list[SloTerm], rows: list[dict] | None = None, per_replica_rps: float | None = None,
         cache_hit: float = 0.0, headroom: float = 0.0, source: str = "given") -> Plan:
    """Replicas for `rps` requests/s: per-replica rate from the measured `rows` (bench summaries) under `slo`, or
    `per_replica_rps` as given; `cache_hit` of requests never reach the model; `headroom` of each replica is kept
    spare (0: run replicas at their measured rate, as the lectures' example does)."""
    _check_inputs(rps, cache_hit, headroom)
    if (rows is None) == (per_replica_rps is None):
        raise LeanLMError("give either a measured curve (--from BENCH.json) or --per-replica-rps, not both")
    result = Plan(rps, cache_hit, headroom, slo, 0.0, source)
    if rows is not None:
        result.points = [check_point(row, slo) for row in rows]
        result.chosen = best_point(result.points)
        chosen = result.points[result.chosen]
        result.per_replica_rps = chosen.request_throughput
        result.notes += _notes(result.points, result.chosen, slo)
    else:
        if not per_replica_rps > 0:
            raise LeanLMError(f"--per-replica-rps must be above zero (got {per_replica_rps})")
        result.per_replica_rps = per_replica_rps
    result.load_rps = rps * (1 - cache_hit)
    result.usable_rps = result.per_replica_rps * (1 - headroom)
    result.replicas = replicas_needed(result.load_rps, result.usable_rps)
    return result


def _notes(points: list[Point], chosen: int, slo: list[SloTerm]) -> list[str]:
    """What the reader should know about how far to trust the chosen point."""
    notes = []
    best = points[chosen]
    if best.load >= max(p.load for p in points) and best.load != float("inf"):
        notes.append("the highest load measured still meets the SLO: a replica may sustain more; sweep higher "
                     "concurrency to find its limit (this plan does not extrapolate)")
    for c in best.checks:
        if c.used != c.term.stat:
            notes.append(f"the bench does not report {c.term.stat}; its {c.used} was used, an upper bound "
                         "(conservative: it may ask for more replicas than needed)")
    for c in best.checks:
        if c.used.startswith("p"):
            enough = 100 / (100 - float(c.used[1:]))  # fewer requests: the nearest rank is the last one
            if best.requests < enough:
                notes.append(f"{best.label} measured {best.requests} requests: its {c.used} is its slowest request; "
                             f"measure at least {math.ceil(round(enough, 9))} for a meaningful {c.used}")
                break
    return notes


def explain(p: Plan) -> list[str]:
    """The reasoning, one line per step, ending in the answer."""
    lines = [f"SLO: {', '.join(map(str, p.slo)) or '(none given)'}"]
    if p.points:
        lines.append(f"measured curve ({p.source}):")
        for i, point in enumerate(p.points):
            values = ", ".join(f"{c.name} {_ms(c.value_ms)}" for c in point.checks)
            verdict = "meets the SLO" if point.meets else f"misses: {point.why_not()}"
            mark = "->" if i == p.chosen else "  "
            lines.append(f"  {mark} {point.label}: {point.request_throughput:.3g} req/s, {values}: {verdict}")
        lines.append(f"per-replica rate: {p.per_replica_rps:.4g} req/s, the best measured point that meets the SLO "
                     f"({p.points[p.chosen].label}; no interpolation between points)")
    else:
        lines.append(f"per-replica rate: {p.per_replica_rps:.4g} req/s (given)")
    lines.append(f"load on the model: {p.rps:.6g} req/s x (1 - {p.cache_hit:g} cache hits) = {p.load_rps:.6g} req/s")
    if p.headroom:
        lines.append(f"usable per replica: {p.per_replica_rps:.4g} x (1 - {p.headroom:g} headroom) = "
                     f"{p.usable_rps:.4g} req/s")
    lines.append(f"replicas: ceil({p.load_rps:.6g} / {p.usable_rps:.4g}) = {p.replicas}")
    lines += [f"note: {n}" for n in p.notes]
    return lines
