"""The quality-vs-cost Pareto frontier, budgets, and the recommendation under a budget."""

from __future__ import annotations

from dataclasses import dataclass, fields

from leanlm.errors import LeanLMError


def frontier(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the non-dominated points when both coordinates are costs (lower is better), sorted by the
    first coordinate. A point is dominated when another is no worse in both and better in one; equal points
    do not dominate each other, so both stay."""
    order = sorted(range(len(points)), key=lambda i: points[i])
    kept, best_y = [], float("inf")
    for i in order:
        x, y = points[i]
        if y < best_y or (kept and points[kept[-1]] == (x, y)):
            kept.append(i)
            best_y = min(best_y, y)
    return kept


@dataclass(frozen=True)
class Budget:
    """What a variant may cost at most; None leaves a measure free.

    latency_ms: time per output token (TPOT) served alone; ttft_ms: time to the first token served alone;
    memory_mb: resident weights; rps: requests/s one replica sustains within the SLO, at least this; ppl_gap:
    perplexity at most (1 + ppl_gap) x the original's; kl: mean KL to the original per token (nats); pass1:
    HumanEval pass@1 at least this (code models)."""

    latency_ms: float | None = None
    ttft_ms: float | None = None
    memory_mb: float | None = None
    rps: float | None = None
    ppl_gap: float | None = None
    kl: float | None = None
    pass1: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> Budget:
        """`latency_ms=12,memory_mb=300,ppl_gap=0.02` -> Budget; an empty text is no budget."""
        names = [f.name for f in fields(cls)]
        values = {}
        for item in filter(None, (s.strip() for s in (text or "").split(","))):
            key, sep, value = item.partition("=")
            if not sep or key.strip() not in names:
                raise LeanLMError(f"budget term {item!r}: write NAME=VALUE with NAME one of {', '.join(names)}")
            try:
                values[key.strip()] = float(value)
            except ValueError:
                raise LeanLMError(f"budget term {item!r}: {value!r} is not a number") from None
            if values[key.strip()] < 0:
                raise LeanLMError(f"budget term {item!r} must not be negative")
        return cls(**values)

    @property
    def bounds_quality(self) -> bool:
        return any(v is not None for v in (self.ppl_gap, self.kl, self.pass1))

    def breaks(self, row: dict) -> list[str]:
        """The terms `row` (a measured variant, see sweep.Measured) breaks, in words; [] when it fits."""
        broken = []
        for name, measured, limit in (("latency_ms", row.get("tpot_ms"), self.latency_ms),
                                      ("ttft_ms", row.get("ttft_ms"), self.ttft_ms),
                                      ("memory_mb", row.get("memory_mb"), self.memory_mb),
                                      ("ppl_gap", row.get("ppl_gap"), self.ppl_gap),
                                      ("kl", row.get("kl"), self.kl)):
            if limit is not None and (measured is None or measured > limit):
                broken.append(f"{name} {_show(measured)} > {limit:g}")
        for name, limit in (("rps", self.rps), ("pass1", self.pass1)):  # at least
            if limit is not None and (row.get(name) is None or row[name] < limit):
                broken.append(f"{name} {_show(row.get(name))} < {limit:g}")
        return broken


def _show(value) -> str:
    return "not measured" if value is None else f"{value:.4g}"


def recommend(rows: list[dict], budget: Budget) -> int | None:
    """Index of the variant to use: among those within the budget, when the budget bounds quality the one that
    serves the most requests/s within the SLO (ties: the lower TPOT), else the most faithful (lowest KL, ties: the
    lower TPOT); then the smaller memory. None when none fits."""
    fit = [i for i, r in enumerate(rows) if not budget.breaks(r) and r.get("tpot_ms") is not None]
    if not fit:
        return None
    if budget.bounds_quality:
        return min(fit, key=lambda i: (-rows[i].get("rps", 0), rows[i]["tpot_ms"], rows[i]["kl"], rows[i]["memory_mb"]))
    return min(fit, key=lambda i: (rows[i]["kl"], rows[i]["tpot_ms"], rows[i]["memory_mb"]))
