"""Two revisions of leanlm's distillation step against each other: seconds a training step and peak memory of the
`distill` recipe step (the trainer AQLM's end-to-end fine-tuning and the int4 QAT step run), each revision in a fresh
process from its own copy of the sources (git archive, in a temporary folder), the revisions alternating for --rounds
rounds. On a shared VM whose speed moves between runs, the ratio within one run is the number to trust.

    python benchmarks/distill_step.py BASE HEAD [--student DIR] [--teacher smollm2-135m] [--steps 6] [--rounds 2]

--student: a quantized model directory (e.g. an AQLM model made by benchmarks/codebook.py under
$LEANLM_CACHE/bench-codebook/); default the teacher itself (a float student: every weight learns). The first step
(warm-up: caches, allocator) is left out of the median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent


def child(student: str, teacher: str, steps: int) -> None:
    """In a fresh process, under the revision's leanlm: the distill step on `student`, each train_step timed."""
    import torch

    from leanlm.compress.registry import apply
    from leanlm.distillation.trainer import Trainer
    from leanlm.models.loading import load
    from leanlm.pipeline import make_config
    from leanlm.runtime import peak_rss_mb

    times, step = [], Trainer.train_step

    def timed(self):
        start = time.perf_counter()
        loss = step(self)
        times.append(time.perf_counter() - start)
        return loss

    Trainer.train_step = timed
    net, _ = load(student, "bfloat16", "cpu", progress=False)
    apply(net, make_config("distill", {"teacher": teacher, "steps": steps}))
    print(json.dumps({"times": times, "peak_mb": peak_rss_mb(), "threads": torch.get_num_threads()}))


def sources(rev: str, root: Path) -> tuple[str, Path]:
    """The files of `rev` under root/<commit> (the repository itself untouched: no worktree or checkout)."""
    sha = subprocess.check_output(["git", "rev-parse", "--short=8", rev], text=True, cwd=REPO).strip()
    path = root / sha
    path.mkdir()
    archive = subprocess.run(["git", "archive", sha], cwd=REPO, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(path)], input=archive, check=True)
    return sha, path


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("revs", nargs=2, help="two git revisions: the base, then the one to compare")
    ap.add_argument("--teacher", default="smollm2-135m")
    ap.add_argument("--student", default=None, help="a model directory (default: the teacher, a float student)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        trees = [sources(rev, Path(root)) for rev in args.revs]
        runs = measure(trees, args)
    t = Table(title=f"distill step: student {args.student or args.teacher}, teacher {args.teacher}, 4 x 256 tokens a "
                    f"step, {runs[trees[0][0]][0]['threads']} threads, {args.rounds} rounds of {args.steps} steps")
    for col in ("revision", "s a step (median)", "steps (s)", "peak MB", "vs base"):
        t.add_column(col, justify="left" if col in ("revision", "steps (s)") else "right")
    base = None
    for sha, _ in trees:
        steady = [s for run in runs[sha] for s in run["times"][1:]]
        median = statistics.median(steady)
        base = base or median
        t.add_row(sha, f"{median:.2f}", " ".join(f"{s:.1f}" for s in steady),
                  f"{max(run['peak_mb'] for run in runs[sha]):.0f}", f"{base / median:.2f}x")
    Console(width=160).print(t)


def measure(trees: list[tuple[str, Path]], args) -> dict[str, list[dict]]:
    """commit -> each round's child result, the revisions alternating."""
    runs = {sha: [] for sha, _ in trees}
    err = Console(stderr=True)
    for r in range(args.rounds):
        for sha, path in trees:
            err.print(f"[dim]round {r + 1}: {sha}[/]")
            env = {**os.environ, "PYTHONPATH": str(path)}
            out = subprocess.run([sys.executable, __file__, "--child", args.student or args.teacher, args.teacher,
                                  str(args.steps)], env=env, cwd=path, check=True, capture_output=True, text=True)
            runs[sha].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return runs


if __name__ == "__main__":
    main()
