"""`leanlm prune`: zero weights (unstructured, N:M) or cut heads, neurons and layers, and save the model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from leanlm import pipeline
from leanlm.cli.common import (CalibrationData, Compact, DType, Model, Samples, SeqLen, _fail, _recipe_alone, app, err,
                               out, recipe_progress)
from leanlm.compress.sparse.masks import decoder_sparsity


@app.command()
def prune(
    model: Model,
    method: Annotated[Optional[str], typer.Option(help="magnitude, wanda, sparsegpt, taylor (zero weights); heads, "
                                                       "neurons, layers (a smaller model)")] = None,
    recipe: Annotated[Optional[Path], typer.Option(help="YAML list of steps applied in order, e.g. `- {method: "
                                                        "sparsegpt, sparsity: 0.5, pattern: \"2:4\"}` then "
                                                        "`- {method: gptq, bits: 4}`")] = None,
    sparsity: Annotated[Optional[float], typer.Option(help="fraction of each projection's weights zeroed, in "
                                                           "[0, 1) (default 0.5)")] = None,
    pattern: Annotated[Optional[str], typer.Option(help="N:M, e.g. 2:4: of every M consecutive inputs of a row "
                                                        "N are kept")] = None,
    target_params: Annotated[Optional[float], typer.Option(help="heads/neurons/layers: fraction of the parameters "
                                                                "kept, e.g. 0.75")] = None,
    bits: Annotated[Optional[int], typer.Option(help="sparsegpt: also quantize the kept weights, 8 (W8A16) or 4 "
                                                     "(W4A16), in the same pass")] = None,
    scope: Annotated[Optional[str], typer.Option(help="magnitude: compare |w| per row (default), layer or "
                                                      "global")] = None,
    owl: Annotated[Optional[float], typer.Option(help="wanda: OWL non-uniform block sparsity, the largest shift "
                                                      "from --sparsity (0.08 in the paper)")] = None,
    heads: Annotated[Optional[int], typer.Option(help="heads: query heads kept per layer")] = None,
    intermediate_size: Annotated[Optional[int], typer.Option(help="neurons: MLP width kept")] = None,
    num_layers: Annotated[Optional[int], typer.Option(help="layers: decoder layers kept")] = None,
    criterion: Annotated[Optional[str], typer.Option(help="neurons: contribution, activation, redundant; layers: "
                                                          "influence, loss")] = None,
    data: CalibrationData = None,
    samples: Samples = 128,
    seq_len: SeqLen = 512,
    compact: Compact = False,
    output: Annotated[Path, typer.Option("--output", "-o", help="directory to write (must not exist)")] = ...,
    dtype: DType = "auto",
) -> None:
    """Prune MODEL and save it to -o DIR: a float model as an ordinary HF directory (every verb and transformers
    load it), a sparse + quantized one in leanlm's quantized format."""
    options = {"sparsity": sparsity, "pattern": pattern, "target_params": target_params, "bits": bits, "scope": scope,
               "owl": owl, "heads": heads, "intermediate_size": intermediate_size, "num_layers": num_layers,
               "criterion": criterion}
    if method is None and recipe is None:
        _fail("give --method (magnitude, wanda, sparsegpt, taylor, heads, neurons, layers) or --recipe FILE")
    # --compact: int8 layers pruned 2:4 (sparsegpt --bits 8, or a recipe's later rtn/gptq 8) stored compactly
    _recipe_alone(recipe, method, options)
    with recipe_progress() as progress:
        built = pipeline.prune(model, method, out=output, recipe=recipe, data=data, samples=samples, seq_len=seq_len,
                               dtype=dtype, compact=compact, progress=progress, status=err.print, **options)
    out.print(f"{model} -> {output} ({' + '.join(c.name for c in built.steps)}: {_summary(built.model)})",
              soft_wrap=True)


def _summary(net) -> str:
    """The model's shape and how many of its projection weights are zero."""
    zeros, pattern = decoder_sparsity(net)
    cfg = net.config
    return (f"{cfg.num_layers} layers, {cfg.num_heads} heads, MLP width {cfg.intermediate_size}; "
            f"{zeros:.1%} of the decoder projections' weights are zero" + (f" ({pattern})" if pattern else ""))
