"""A model's batch-1 cost, measured in a fresh process (`isolated(...)` runs `python -m leanlm.bench.cost JSON`), so
that one model's compiled graphs, allocator and threads never touch another's timing (`leanlm compare`):
`bench.latency.bench` on random tokens (TTFT of the prompt, median TPOT, MBU, prefill MFU, peak RSS).
`leanlm optimize` times its variants as served instead (optimize.served).
"""

from __future__ import annotations

import json
import subprocess
import sys

from leanlm.bench.latency import bench
from leanlm.errors import LeanLMError
from leanlm.generation.threads import pick_threads
from leanlm.models.loading import load


def measure(model: str, dtype: str, compiled: bool, threads: int | None, prompt_tokens: int, new_tokens: int) -> dict:
    net, _ = load(model, dtype, None, progress=False)
    pick_threads(net, threads)
    return bench(net, model, prompt_tokens, new_tokens, 1, compiled=compiled).to_dict()


def isolated(what: str, **args) -> dict:
    """measure(**args) in a fresh process; a failure is one LeanLMError naming `what` and the child's last line."""
    proc = subprocess.run([sys.executable, "-m", "leanlm.bench.cost", json.dumps(args)], capture_output=True,
                          text=True)
    if proc.returncode:
        raise LeanLMError(f"timing {what} failed: {last_line(proc.stderr) or f'exit status {proc.returncode}'}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def last_line(text: str) -> str:
    """A child process's last non-blank line of output ("" when it wrote none): its error message."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


if __name__ == "__main__":
    print(json.dumps(measure(**json.loads(sys.argv[1]))))
