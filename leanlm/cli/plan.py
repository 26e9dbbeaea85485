"""`leanlm plan`: how many replicas a served variant needs for a request rate under a latency SLO."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from leanlm.cli.common import _fail, app, out
from leanlm.optimize.plan import explain, parse_slo, plan as make_plan, read_curve


@app.command()
def plan(
    rps: Annotated[float, typer.Option(help="requests per second expected at peak")],
    slo: Annotated[Optional[str], typer.Option(help="latency SLO a replica must meet, comma-separated "
                                                    "STAT_METRIC=VALUE: e.g. p95_e2e=3s,p99_ttft=500ms (STAT: pNN "
                                                    "or mean; METRIC: ttft, tpot, itl, e2e; unit s or ms)")] = None,
    from_: Annotated[Optional[Path], typer.Option("--from", help="measured curve: the JSON of `leanlm bench serve "
                                                                 "MODEL --sweep 1,2,4,8 --json`")] = None,
    per_replica_rps: Annotated[Optional[float], typer.Option(help="instead of --from: requests/s one replica "
                                                                  "sustains within the SLO, as known")] = None,
    cache_hit: Annotated[float, typer.Option(help="fraction of requests answered by a cache, never reaching the "
                                                  "model, in [0, 1)")] = 0.0,
    headroom: Annotated[float, typer.Option(help="fraction of each replica's measured rate kept spare for bursts "
                                                 "and failures, in [0, 1) (e.g. 0.2)")] = 0.0,
    json_: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """How many replicas (machines as benchmarked) serve RPS within the SLO: the highest request rate one replica
    was measured to sustain with every SLO term met (no interpolation, no extrapolation), then
    ceil(rps x (1 - cache_hit) / (per-replica rate x (1 - headroom)))."""
    if (from_ is None) == (per_replica_rps is None):
        _fail("give a measured curve with --from BENCH.json (from `leanlm bench serve MODEL --sweep 1,2,4,8 "
              "--json`) or a known --per-replica-rps, one of the two")
    if from_ is not None and slo is None:
        _fail("--from needs --slo, the latency a replica must meet (e.g. --slo p95_e2e=3s)")
    terms = parse_slo(slo) if slo is not None else []
    rows = read_curve(from_) if from_ is not None else None
    result = make_plan(rps, terms, rows, per_replica_rps, cache_hit, headroom, str(from_) if from_ else "given")
    if json_:
        print(json.dumps(result.to_dict()))
    else:
        out.print("\n".join(explain(result)), highlight=False, markup=False)
