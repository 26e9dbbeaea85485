"""`leanlm <verb>`: each verb a thin wrapper over the public API, a module per verb group."""

from __future__ import annotations

import sys

from leanlm.cli import optimize, generate, measure, compress, prune, distill, distill_data, serve, analyze, plan  # noqa: F401, I001  (each registers its verbs, in help order)
from leanlm.cli.common import app, err
from leanlm.errors import LeanLMError
from leanlm.runtime import follow_parent


def _default_lookup(argv: list[str]) -> list[str]:
    """`--prompt-lookup` given without a number means n-grams up to 3."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--prompt-lookup" and (i + 1 == len(out) or not out[i + 1].isdigit()):
            out.insert(i + 1, "3")
    return out


def main() -> None:
    follow_parent()
    args = _default_lookup(sys.argv[1:])
    if args[:2] == ["bench", "serve"]:  # `bench MODEL` measures one model; `bench serve` a server under load
        args = ["bench-serve", *args[2:]]
    try:
        app(args=args)
    except LeanLMError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
