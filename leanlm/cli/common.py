"""What every verb shares: the Typer app, the consoles, argument types, loading and failing."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import Progress

from leanlm.models.loading import load
from leanlm.generation.threads import pick_threads

app = typer.Typer(help="Make transformer language models cheap to run, and see what it costs.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
err = Console(stderr=True)
# Piped or redirected, rich would fit tables to 80 columns by cutting cells (numbers too); print them whole.
out = Console() if sys.stdout.isatty() else Console(width=200)

Model = Annotated[str, typer.Argument(help="zoo name (see `leanlm pull --list`), HF model directory, or .gguf file")]
DType = Annotated[str, typer.Option(help="weights/activations dtype: auto (bfloat16), float32, bfloat16, float16")]
Device = Annotated[str, typer.Option(help="cpu or cuda (auto: cuda when present)")]
Threads = Annotated[Optional[int], typer.Option(help="CPU threads (default: the fastest, found by a short probe)")]
KVCache = Annotated[str, typer.Option(help="KV cache storage: auto (the model's dtype), int8 (per token/head: "
                                            "about twice the tokens in the same memory) or int4 (serving engine only; "
                                            "keys per channel, values per token: about 2.7x the bfloat16 tokens)")]
CalibrationData = Annotated[Optional[Path], typer.Option(help="calibration text file or folder (default: built-in "
                                                              "calibration split)")]
Samples = Annotated[int, typer.Option(help="calibration windows")]
SeqLen = Annotated[int, typer.Option(help="tokens per calibration window")]
Compact = Annotated[bool, typer.Option(help="store int8 layers pruned 2:4 compactly (kept values + position masks, "
                                            "0.625 B a weight, scheme w8a16_2:4): 37% less memory, but its kernel "
                                            "decodes slower than dense int8 on Zen 4")]


def _fail(message: str) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _recipe_alone(recipe, method: str | None, options: dict) -> None:
    """--recipe sets every option itself: none of `options` (None: not given) and no --method beside it."""
    given = [f"--{k.replace('_', '-')}" for k, v in options.items() if v is not None] + (["--method"] if method else [])
    if recipe is not None and given:
        _fail(f"--recipe sets every option itself; drop {', '.join(given)}")


def _load(model: str, dtype: str, device: str, threads: int | None, quiet: bool = False):
    net, tok = load(model, dtype, device, progress=not quiet)
    threads, _ = pick_threads(net, threads)
    return net, tok, threads


@contextmanager
def recipe_progress():
    """A progress bar per recipe step on stderr: the pipeline's `progress` callback."""
    with Progress(console=err, transient=True) as bar:
        def step(name: str, ticks: int | None):
            task = bar.add_task(name, total=ticks)
            return lambda layer: bar.advance(task)

        yield step
