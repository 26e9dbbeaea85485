"""What every verb shares: the Typer app, the consoles, argument types, loading and failing."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer
from rich.console import Console

app = typer.Typer(help="Make transformer language models cheap to run, and see what it costs.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
err = Console(stderr=True)
# Piped or redirected, rich would fit tables to 80 columns by cutting cells (numbers too); print them whole.
out = Console() if sys.stdout.isatty() else Console(width=200)

Model = Annotated[str, typer.Argument(help="zoo name (see `leanlm pull --list`), HF model directory, or .gguf file")]
DType = Annotated[str, typer.Option(help="weights/activations dtype: auto (bfloat16), float32, bfloat16, float16")]
Device = Annotated[str, typer.Option(help="cpu or cuda (auto: cuda when present)")]
Threads = Annotated[Optional[int], typer.Option(help="CPU threads (default: the fastest, found by a short probe)")]
KVCache = Annotated[str, typer.Option(help="KV cache storage: 16 (the model dtype) or int8 (per token/head: about "
                                            "twice the tokens in the same memory)")]
Compact = Annotated[bool, typer.Option(help="store int8 layers pruned 2:4 compactly (kept values + position masks, "
                                            "0.625 B a weight, scheme w8a16_2:4): 37% less memory, but its kernel "
                                            "decodes slower than dense int8 on Zen 4")]


def _fail(message: str) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _int8_kv(kv_cache: str) -> bool:
    """--kv-cache: 16 or int8; whether it is int8."""
    if kv_cache not in ("16", "int8"):
        _fail(f"--kv-cache must be 16 or int8, got {kv_cache!r}")
    return kv_cache == "int8"


def _load(model: str, dtype: str, device: str, threads: int | None, quiet: bool = False):
    from leanlm.api import load
    from leanlm.runtime import pick_threads

    net, tok = load(model, dtype, device, progress=not quiet)
    threads, _ = pick_threads(net, threads)
    return net, tok, threads




def _method_configs(method: str | None, recipe, options: dict, default: str | None = None) -> list:
    """A recipe's steps, or one method (or `default`) with the options given (None: not given)."""
    from leanlm.compress.registry import make_config, read_recipe

    if recipe is not None:
        given = [f"--{k.replace('_', '-')}" for k, v in options.items() if v is not None] + (["--method"] if method else [])
        if given:
            _fail(f"--recipe sets every option itself; drop {', '.join(given)}")
        return read_recipe(recipe)
    return [make_config(method or default, {k: v for k, v in options.items() if v is not None})]


def _with_teacher(configs: list, source) -> list:
    """A distill step that names no teacher learns from the model the recipe starts from."""
    from dataclasses import replace

    return [replace(c, teacher=str(source)) if c.name == "distill" and c.teacher is None else c for c in configs]


def _check_run(output, samples: int, seq_len: int) -> None:
    """A compress verb's output must be new and its calibration sizes positive."""
    if output.exists():
        _fail(f"{output} already exists; choose a new output directory")
    for name, value in (("samples", samples), ("seq-len", seq_len)):
        if value < 1:
            _fail(f"--{name} must be at least 1")


def _calibration(configs: list, tok, data, samples: int, seq_len: int, context: int):
    """Calibration token ids [samples, seq_len] when a step needs data, else None; windows longer than the
    model's `context` are cut to it (the default 512 is more than some models take)."""
    if not any(getattr(c, "needs_data", False) for c in configs):
        return None
    from leanlm.eval.datasets import calibration_samples, load_text

    if seq_len > context:
        err.print(f"calibration windows of {context} tokens, the model's context window (--seq-len {seq_len})")
        seq_len = context
    return calibration_samples(tok.encode(load_text(data, split="calibration")), samples, seq_len)


def _apply_steps(net, configs: list, calibration, records: dict[str, dict], total=lambda config: None,
                 compact: bool = False) -> dict:
    """Apply each step in order (a progress bar on stderr, `total(config)` ticks each); return `records` with each
    step's merged in (registry.merge_records: a layer pruned, then quantized, keeps both; after layers are removed,
    every record names the saved model's layers). With `compact`, int8 layers pruned 2:4 (by this run or the
    source's pruning) are then stored compactly, so prune's recipe and prune-then-quantize write the same model."""
    from rich.progress import Progress

    from leanlm.compress.registry import apply, merge_records
    from leanlm.lowbit.record import note_pruning

    with Progress(console=err, transient=True) as bar:
        for config in configs:
            task = bar.add_task(config.name, total=total(config))
            step = apply(net, config, progress=lambda name: bar.advance(task), samples=calibration)
            records = merge_records(records, step)
    if compact:
        from leanlm.compress.sparse.compact import compact_24

        compact_24(net, records)
    note_pruning(net, records)  # a quantized layer's codes cannot say what pruning did before
    return records
