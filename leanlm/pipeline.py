"""The recipe pipeline as a library: resolve a model, load it, calibrate, apply a recipe's steps in order and save
the result atomically. `leanlm quantize`, `leanlm prune` and optimize's sweep run it; Python users call
`leanlm.quantize(...)` and `leanlm.prune(...)`.

It is a job, on the floor above compress/ and distillation/: a recipe may hold a distill step (a training run), so
the one module that knows every method sits above both. Adding a method is one new module and one import below.

    python -m leanlm.pipeline quantize '{"model": ..., "recipe": [{"method": "gptq", "bits": 4}], "out": ...}'

runs `quantize` (or `prune`) in a fresh process, with its keyword arguments: what optimize's sweep does, for
isolation.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

import yaml
from torch import nn

from leanlm.compress.quant import aqlm, autoround, awq, gptq, hqq, llm_int8, rotate, rtn, smoothquant  # noqa: F401
from leanlm.compress.quant import format as qformat
from leanlm.compress.registry import METHODS, apply, decoder_linears, merge_records, recipe_steps
from leanlm.compress.sparse import magnitude, sparsegpt, structured, taylor, wanda  # noqa: F401
from leanlm.compress.sparse.compact import compact_24
from leanlm.compress.sparse.save import read_record, save_float
from leanlm.distillation import step as distill_step  # noqa: F401  (registers `distill`)
from leanlm.errors import LeanLMError
from leanlm.eval.datasets import calibration_samples, load_text
from leanlm.fetch import atomic_dir
from leanlm.lowbit.record import is_quantized, note_pruning
from leanlm.models.loading import load
from leanlm.models.zoo import resolve
from leanlm.runtime import follow_parent

# progress(step name, ticks expected or None) -> the callback the step calls once per layer done
Progress = Callable[[str, "int | None"], Callable[[str], None]]


def method(name: str) -> type:
    """The config class of method `name`."""
    try:
        return METHODS[name]
    except KeyError:
        raise LeanLMError(f"unknown method {name!r}; choose one of: {', '.join(sorted(METHODS))}") from None


def make_config(name: str, options: dict):
    """The config of method `name` from option values; a clear error for an option it does not take."""
    cls = method(name)
    known = [f.name for f in fields(cls)]
    unknown = [k for k in options if k not in known]
    if unknown:
        takes = f"its options: {', '.join(known)}" if known else "it takes no options"
        raise LeanLMError(f"{name} has no option {', '.join(unknown)} ({takes})")
    return cls(**options)


def recipe_configs(steps: list[dict], where: str = "a recipe", form: str = "list of steps such as {method: rtn}"
                   ) -> list:
    """Configs from steps {method: NAME, option: value, ...}, applied in order. A method quantizes the projections
    that earlier steps left in float, so `smooth` then `rtn` is SmoothQuant."""
    if not isinstance(steps, list) or not steps or not all(isinstance(s, dict) and "method" in s for s in steps):
        raise LeanLMError(f"{where} must be a non-empty {form}")
    return [step_config(s) for s in steps]


def step_config(step: dict):
    """The config of one step {method: NAME, option: value, ...}."""
    return make_config(step["method"], {k: v for k, v in step.items() if k != "method"})


def read_recipe(path: Path) -> list:
    """The configs of a YAML recipe file (recipe_configs)."""
    try:
        steps = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise LeanLMError(f"cannot read recipe {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise LeanLMError(f"recipe {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    return recipe_configs(steps, f"recipe {path}", "YAML list of steps such as `- method: rtn`")


def with_teacher(configs: list, source) -> list:
    """A distill step that names no teacher learns from the model the recipe starts from."""
    return [replace(c, teacher=str(source)) if c.name == "distill" and c.teacher is None else c for c in configs]


def calibration(configs: list, tok, data, samples: int, seq_len: int, context: int, status=print):
    """Calibration token ids [samples, seq_len] when a step needs data, else None; windows longer than the
    model's `context` are cut to it (the default 512 is more than some models take)."""
    if not any(getattr(c, "needs_data", False) for c in configs):
        return None
    return calibration_windows(tok, data, samples, seq_len, context, status)


def calibration_windows(tok, data, samples: int, seq_len: int, context: int, status=print):
    """`samples` windows [samples, seq_len] of the calibration text (`data`, or the built-in split), cut to the
    model's `context` when longer."""
    if seq_len > context:
        status(f"calibration windows of {context} tokens, the model's context window (seq_len {seq_len})")
        seq_len = context
    return calibration_samples(tok.encode(load_text(data, split="calibration")), samples, seq_len)


def apply_steps(net: nn.Module, configs: list, samples, records: dict[str, dict], progress: Progress | None = None,
                compact: bool = False) -> dict:
    """Apply each step in order; return `records` with each step's merged in (registry.merge_records: a layer
    pruned, then quantized, keeps both; after layers are removed, every record names the saved model's layers).
    With `compact`, int8 layers pruned 2:4 (by this run or the source's pruning) are then stored compactly, so
    prune's recipe and prune-then-quantize write the same model."""
    layers = sum(1 for _ in decoder_linears(net))
    for config in configs:
        ticks = 1 if config.name == "lm_head" else layers if config.kind == "quantize" else None
        tick = progress(config.name, ticks) if progress else None
        records = merge_records(records, apply(net, config, progress=tick, samples=samples))
    if compact:
        compact_24(net, records)
    note_pruning(net, records)  # a quantized layer's codes cannot say what pruning did before
    return records


@dataclass
class Built:
    """What a run wrote: the directory, the model as saved (in memory, ready to use), the steps applied, and what
    each layer became (its record)."""

    path: Path
    model: nn.Module
    steps: list
    records: dict[str, dict]

    @property
    def quantized(self) -> bool:
        return any(hasattr(m, "BITS") for m in self.model.modules())


def run(model: str | Path, steps: list, out: str | Path, *, data: str | Path | None = None, samples: int = 128,
        seq_len: int = 512, dtype: str = "auto", compact: bool = False, progress: Progress | None = None,
        status: Callable[[str], None] = lambda message: None) -> Built:
    """Apply `steps` (configs, or {method: ..., option: ...} dicts) to `model` (a zoo name or directory, in float)
    and save it to the new directory `out`: in leanlm's quantized format when a step quantized, else as an ordinary
    HF directory with pruning.json. A pruned source's record and steps go on with this run's. Calibrated steps read
    `samples` windows of `seq_len` tokens of `data` (default: the built-in calibration split)."""
    out = Path(out)
    if out.exists():
        raise LeanLMError(f"{out} already exists; choose a new output directory")
    for name, value in (("samples", samples), ("seq_len", seq_len)):
        if value < 1:
            raise LeanLMError(f"{name} must be at least 1, got {value}")
    configs = [step_config(c) if isinstance(c, dict) else c for c in steps]
    source = resolve(str(model))
    configs = with_teacher(configs, source)
    if is_quantized(source):
        raise LeanLMError(f"{model} is already quantized; start from the float model (prune it, then quantize, "
                          "or give one recipe that does both)")
    net, tok = load(source, dtype, "cpu", progress=False)
    ids = calibration(configs, tok, data, samples, seq_len, net.config.max_position, status)
    before = read_record(source)  # a source pruned before: its layers' sparsity and its steps go on
    records = apply_steps(net, configs, ids, dict(before.get("layers", {})), progress, compact)
    saved = [*before.get("recipe", []), *configs]
    built = Built(out, net, configs, records)
    with atomic_dir(out) as tmp:
        if built.quantized:
            qformat.save(net, records, saved, source, tmp)
        else:
            save_float(net, source, tmp, {"recipe": recipe_steps(saved), "layers": records})
    return built


def default_lm_head(configs: list) -> int:
    """8 when a step quantizes weights to 4 bits or fewer (and none quantizes the lm_head itself), else 16. A 16-bit
    head kept 4-bit decode of the default model at 1.4-1.7x bf16 on one thread, against 2.4-2.6x with an int8 one, at
    no measurable cost in perplexity."""
    four_bit = any((getattr(c, "bits", None) or 16) <= 4 for c in configs)
    return 8 if four_bit and not any(c.name == "lm_head" for c in configs) else 16


def _configs(method_name: str | None, recipe, options: dict, default: str | None, verb: str) -> list:
    """A recipe's steps (a YAML file or a list of step dicts), or one method with the options given (None: not
    given)."""
    given = {k: v for k, v in options.items() if v is not None}
    if recipe is not None:
        if given or method_name:
            raise LeanLMError(f"a recipe sets every option itself; drop {', '.join([*given, *(['method'] * bool(method_name))])}")
        return read_recipe(recipe) if isinstance(recipe, (str, Path)) else recipe_configs(list(recipe))
    if method_name is None and default is None:
        raise LeanLMError(f"{verb} needs a method (one of {', '.join(sorted(METHODS))}) or a recipe")
    return [make_config(method_name or default, given)]


def quantize(model: str | Path, method: str | None = None, *, out: str | Path, recipe=None, lm_head: int | None = None,
             data=None, samples: int = 128, seq_len: int = 512, dtype: str = "auto", compact: bool = False,
             progress: Progress | None = None, status=lambda message: None, **options) -> Built:
    """leanlm.quantize("smollm2-135m", method="gptq", bits=4, out="w4"): quantize the decoder projections onto the
    runtime's kernels (what `leanlm quantize` writes). `options` are the method's (bits, group_size, act_bits,
    act_order, alpha, threshold, ...); `recipe` is a YAML file or a list of steps instead. 4-bit weights get an int8
    lm_head unless `lm_head=16`."""
    configs = _configs(method, recipe, options, "rtn", "quantize")
    head = default_lm_head(configs) if lm_head is None else lm_head
    if head != 16:
        configs.append(make_config("lm_head", {"bits": head, "group_size": options.get("group_size") or 128}))
    return run(model, configs, out, data=data, samples=samples, seq_len=seq_len, dtype=dtype, compact=compact,
               progress=progress, status=status)


def prune(model: str | Path, method: str | None = None, *, out: str | Path, recipe=None, data=None,
          samples: int = 128, seq_len: int = 512, dtype: str = "auto", compact: bool = False,
          progress: Progress | None = None, status=lambda message: None, **options) -> Built:
    """leanlm.prune("smollm2-135m", method="wanda", sparsity=0.5, out="w50"): zero weights (magnitude, wanda,
    sparsegpt, taylor; unstructured or N:M) or cut heads, neurons or layers (what `leanlm prune` writes).
    `options` are the method's (sparsity, pattern, target_params, bits, ...); `recipe` a YAML file or step list."""
    configs = _configs(method, recipe, options, None, "prune")
    return run(model, configs, out, data=data, samples=samples, seq_len=seq_len, dtype=dtype, compact=compact,
               progress=progress, status=status)


if __name__ == "__main__":  # one recipe in this process: the sweep's isolated build
    follow_parent()
    verb, args = {"quantize": quantize, "prune": prune}[sys.argv[1]], json.loads(sys.argv[2])
    try:
        verb(args.pop("model"), **args)
    except LeanLMError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
