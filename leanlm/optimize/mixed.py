"""The sweep's mixed-precision variant: per-projection sensitivity (measured once, cached), then the knapsack's
4/8-bit assignment at the size of uniform 4-bit g32, swept next to uniform w4 g32 so the report compares the two
at equal size."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from leanlm.compress.registry import recipe_steps
from leanlm.eval.datasets import load_text
from leanlm.models.loading import load
from leanlm.optimize import sensitivity as sens  # through the module: a test replaces sens.layer_sensitivity
from leanlm.optimize.variants import HEAD8_G, Variant, digest

OPTIONS = ("w4g128", "w4g32", "w8")  # what each projection may get
EQUAL_TO = "w4g32"  # the mixed variant may take no more bytes than this option everywhere
TOKENS = 512  # of the calibration text (not the evaluation text the sweep scores on); ~0.9 s a projection and option


def sensitivity(source: Path, root: Path, tokens: int = TOKENS, status=lambda text: None):
    """The KL each decoder projection causes alone under each of OPTIONS (float32 model, calibration text); cached
    in root/sensitivity/."""
    path = root / "sensitivity" / f"{digest([OPTIONS, tokens])}.json"
    if path.exists():
        return sens.Sensitivity.from_dict(json.loads(path.read_text()))
    net, tok = load(source, "float32", "cpu", progress=False)
    ids = torch.tensor(tok.encode(load_text(None, "calibration")[: tokens * 8])[:tokens])
    count = [0]

    def tick(name, option):
        count[0] += 1
        status(f"sensitivity: {name} {option} ({count[0]})")

    result = sens.layer_sensitivity(net, ids, [sens.parse_option(o) for o in OPTIONS], window=min(512, tokens),
                                    progress=tick)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_dict()))
    return result


def variants(result) -> tuple[Variant, Variant]:
    """Uniform w4 g32 and the knapsack's mix of OPTIONS within its bytes, each with an int8 lm_head."""
    budget = sens.assignment_bytes(result, {u.name: EQUAL_TO for u in result.units})
    assignment = sens.mixed_assignment(result, list(OPTIONS), budget_bytes=budget)
    (step,) = recipe_steps([sens.mixed_config(assignment)])
    counts = {o: sum(a == o for a in assignment.values()) for o in OPTIONS}
    notes = "knapsack on per-projection KL at uniform w4 g32's bytes: " + ", ".join(f"{n} {o}" for o, n in counts.items())
    return (Variant("w4 rtn g32+head8", ({"method": "rtn", "bits": 4, "group_size": 32}, HEAD8_G)),
            Variant("mixed 4/8 rtn+head8", (step, HEAD8_G), notes=notes))
