"""`leanlm quantize`, `leanlm export`: compress a model, write it for other runtimes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from rich.progress import Progress

from leanlm import pipeline
from leanlm.cli.common import (CalibrationData, Compact, DType, Model, Samples, SeqLen, _fail, _recipe_alone, app, err,
                               out, recipe_progress)
from leanlm.compress.quant.export import export as write
from leanlm.fetch import atomic_dir
from leanlm.lowbit.record import RECORD, is_quantized
from leanlm.models.loading import load_model
from leanlm.models.zoo import resolve
from leanlm.prompt.compressor import PromptCompressor


@app.command()
def quantize(
    model: Model,
    method: Annotated[Optional[str], typer.Option(help="rtn, gptq, awq, hqq, autoround, aqlm, smoothquant, llm_int8, fp8 (smooth, "
                                                       "lm_head: for recipes); default rtn")] = None,
    recipe: Annotated[Optional[Path], typer.Option(help="YAML list of steps applied in order, each a method and "
                                                        "its options, e.g. `- method: smooth` then `- {method: rtn, "
                                                        "bits: 8, act_bits: 8}`; rtn also takes per-projection `layers: {GLOB: 4 | 8 | 16 | "
                                                        "{bits: 4, group_size: 32}}`, aqlm `layers: {GLOB: 1-4 codebooks}`")] = None,
    bits: Annotated[Optional[int], typer.Option(help="weight bits: 8 (per-channel int8) or 4 (int4 groups); aqlm: "
                                                    "1-4 (8-bit codebooks per 8 weights); default: the method's (rtn "
                                                    "8, gptq/awq/hqq/autoround 4, aqlm 2)")] = None,
    group_size: Annotated[Optional[int], typer.Option(help="int4 group size along K: 32, 64 or 128 (default; a "
                                                          "layer whose K it does not divide gets the largest that does)")] = None,
    act_bits: Annotated[Optional[int], typer.Option(help="16 weight-only (default) or 8: per-token int8 activations "
                                                        "(rtn: W8A8 or W4A8; gptq/awq/hqq/autoround: W4A8)")] = None,
    symmetric: Annotated[Optional[bool], typer.Option("--symmetric/--asymmetric", help="int4 grid: codes -8..7 "
                                                      "(absmax / 7; autoround: the auto-round package's full range, "
                                                      "the larger extreme at -8) or zero points (default); "
                                                      "8-bit weights are always symmetric")] = None,
    act_order: Annotated[Optional[bool], typer.Option("--act-order/--no-act-order", help="gptq: quantize columns by "
                                                      "decreasing Hessian diagonal (default on)")] = None,
    iters: Annotated[Optional[int], typer.Option(help="autoround: signed-gradient steps per block (default 200, "
                                                      "~0.3 s each for SmolLM2-135M on 2 cores); hqq: solver "
                                                      "iterations (default 20); aqlm: Adam steps of each block's "
                                                      "codebooks on its output (default 100)")] = None,
    alpha: Annotated[Optional[float], typer.Option(help="smoothquant: migration strength in [0, 1] (default: each "
                                                        "projection's own, searched on the calibration data)")] = None,
    threshold: Annotated[Optional[float], typer.Option(help="llm_int8: |x| from which an input column stays in 16 "
                                                            "bits (default 6.0)")] = None,
    lm_head: Annotated[Optional[int], typer.Option(help="also quantize the output projection: 8 or 4 bits, 16 leaves "
                                                       "it (default: 8 with 4-bit weights, else 16)")] = None,
    data: CalibrationData = None,
    samples: Samples = 128,
    seq_len: SeqLen = 512,
    compact: Compact = False,
    output: Annotated[Path, typer.Option("--output", "-o", help="directory to write (must not exist)")] = ...,
    dtype: DType = "auto",
) -> None:
    """Quantize MODEL's decoder projections onto the runtime int8/int4/fp8 kernels and save it to -o DIR
    (calibrated methods read --samples x --seq-len tokens of the calibration text)."""
    options = {"bits": bits, "group_size": group_size, "symmetric": symmetric, "act_bits": act_bits,
               "act_order": act_order, "iters": iters, "alpha": alpha, "threshold": threshold}
    _recipe_alone(recipe, method, options)
    with recipe_progress() as progress:
        built = pipeline.quantize(model, method, out=output, recipe=recipe, lm_head=lm_head, data=data,
                                  samples=samples, seq_len=seq_len, dtype=dtype, compact=compact, progress=progress,
                                  status=err.print, **options)
    quantized = sum("scheme" in r for r in built.records.values())
    compacted = sum(r.get("scheme") == "w8a16_2:4" for r in built.records.values())
    out.print(f"{model} -> {output} ({' + '.join(c.name for c in built.steps)}, {quantized} layers quantized"
              + (f", {compacted} of them stored 2:4-compact" if compacted else "") + ")")


@app.command()
def export(
    model: Annotated[Path, typer.Argument(help="a directory written by `leanlm quantize` (gguf: also a float model, "
                                               "a zoo name or an HF directory)")],
    output: Annotated[Path, typer.Option("--output", "-o", help="directory (gguf: .gguf file) to write; must not "
                                                                "exist")] = ...,
    format: Annotated[str, typer.Option("--format", help="compressed-tensors (vLLM, transformers) or gguf "
                                                         "(llama.cpp, Ollama)")] = "compressed-tensors",
    round_offsets: Annotated[bool, typer.Option(help="gguf: write int4 groups whose Q4_1 offset float16 cannot "
                                                     "hold exactly with that offset rounded (codes and scales stay "
                                                     "exact); without it such a model is refused")] = False,
    type: Annotated[Optional[str], typer.Option("--type", help="gguf: quantize a float model to one of llama.cpp's "
                                                               "k-quant mixtures: Q2_K, Q3_K_M, Q4_K_M, Q5_K_M, "
                                                               "Q6_K")] = None,
    imatrix: Annotated[bool, typer.Option(help="gguf --type: weigh each weight by an importance matrix (each "
                                               "input's mean square over the calibration windows, as llama-imatrix "
                                               "collects it)")] = False,
    imatrix_file: Annotated[Optional[Path], typer.Option(help="gguf --type: weigh by this importance matrix, a "
                                                              "GGUF file written by llama.cpp's llama-imatrix")] = None,
    data: CalibrationData = None,
    samples: Samples = 128,
    seq_len: SeqLen = 512,
) -> None:
    """Write MODEL for another runtime: a quantized model in the compressed-tensors layout that vLLM and
    transformers load (w4a16, w8a16, w8a8 and fp8 layers), or any model as one GGUF file for llama.cpp (16-bit
    weights as they are, w8a16 as Q8_0, w4a16 as Q4_1; the integer codes are kept as they are), or a float model
    as a k-quant GGUF (--type Q4_K_M, optionally --imatrix)."""
    if format not in ("compressed-tensors", "gguf"):
        _fail(f"--format must be compressed-tensors or gguf, got {format!r}")
    if format == "gguf":
        return _export_gguf(str(model), output, round_offsets, type, imatrix, imatrix_file, data, samples, seq_len)
    if type or imatrix or imatrix_file:
        _fail("--type, --imatrix and --imatrix-file are for --format gguf")
    if not is_quantized(model):
        _fail(f"{model} is not a directory written by `leanlm quantize`")
    if output.exists():
        _fail(f"{output} already exists; choose a new output directory")
    record = json.loads((model / RECORD).read_text())
    net = load_model(model, record["dtype"])  # the 16-bit parts as they were saved
    with atomic_dir(output) as tmp:
        qconfig = write(net, model, tmp)
    groups = ", ".join(f"{len(g['targets'])} {g['format']}" for g in qconfig["config_groups"].values())
    out.print(f"{model} -> {output} (compressed-tensors: {groups} layers)")


def _export_gguf(model: str, output: Path, round_offsets: bool, mixture: str | None, imatrix: bool,
                 imatrix_file: Path | None, data: Path | None, samples: int, seq_len: int) -> None:
    from leanlm.compress.quant.gguf_export import export_gguf, read_imatrix  # the gguf package: only here
    from leanlm.compress.quant.kquants import MIXTURES

    if output.exists():
        _fail(f"{output} already exists; choose a new file name")
    if mixture is not None and mixture not in MIXTURES:
        _fail(f"--type must be one of {', '.join(MIXTURES)}, got {mixture!r}")
    if (imatrix or imatrix_file) and mixture is None:
        _fail("an importance matrix weighs a k-quant's rounding: give --type too (e.g. --type Q4_K_M)")
    if imatrix and imatrix_file:
        _fail("--imatrix collects an importance matrix, --imatrix-file reads one: give one of them")
    given = read_imatrix(imatrix_file) if imatrix_file else None  # a bad file fails before the model loads
    source = resolve(model)
    if is_quantized(source):
        dtype = json.loads((source / RECORD).read_text())["dtype"]  # the 16-bit parts as they were saved
    else:  # a float model's own 16-bit dtype; float32 is written as float16, as llama.cpp's converter does
        config = json.loads((source / "config.json").read_text())
        dtype = "bfloat16" if config.get("torch_dtype", config.get("dtype")) == "bfloat16" else "float16"
    net = load_model(source, dtype)
    matrix = _importance(net, source, data, samples, seq_len) if imatrix else given
    with Progress(console=err, transient=True) as bar:
        task = bar.add_task(f"{mixture or 'GGUF'}: tensors", total=None)
        written = export_gguf(net, source, output, round_offsets, mixture, matrix,
                              progress=lambda: bar.advance(task))
    types = ", ".join(f"{n} {t}" for t, n in sorted(written.types.items()))
    rounded = (f"; {written.rounded_offsets} of {written.offsets} int4 group offsets rounded to float16"
               if written.rounded_offsets else "")
    out.print(f"{model} -> {output} (GGUF: {types} tensors{rounded})", soft_wrap=True)


def _importance(net, source: Path, data: Path | None, samples: int, seq_len: int) -> dict:
    """The importance matrix over `samples` calibration windows of the text (see gguf_export.importance_matrix)"""
    from leanlm.compress.quant.gguf_export import importance_matrix
    from leanlm.tokenizer import Tokenizer

    windows = pipeline.calibration_windows(Tokenizer(source), data, samples, seq_len, net.config.max_position,
                                           err.print)
    with Progress(console=err, transient=True) as bar:
        task = bar.add_task("importance matrix: windows", total=samples)
        return importance_matrix(net, windows, progress=lambda n: bar.advance(task, n))


@app.command("compress-prompt")
def compress_prompt(
    text: Annotated[Optional[str], typer.Argument(help="the prompt's context (or --file)")] = None,
    file: Annotated[Optional[Path], typer.Option("--file", "-f", help="read the context from this file ('-': "
                                                                      "standard input)")] = None,
    question: Annotated[str, typer.Option(help="asked after the context and kept whole; it ranks the context's "
                                               "units (LongLLMLingua)")] = "",
    instruction: Annotated[str, typer.Option(help="put before the context and kept whole")] = "",
    rate: Annotated[float, typer.Option(help="fraction of the prompt's tokens to keep (0.5: 2x, 0.2: 5x)")] = 0.5,
    target_tokens: Annotated[Optional[int], typer.Option(help="tokens to keep (instead of --rate)")] = None,
    method: Annotated[str, typer.Option(help="llmlingua (units, question-aware with --question, then tokens by "
                                             "perplexity given the compressed prefix), longllmlingua (tokens by "
                                             "contrastive perplexity against --question), classifier (one pass "
                                             "of a keep/drop classifier trained on llmlingua's choices, 25-30x "
                                             "faster; made on first use, ~4 min on 2 cores, then cached), "
                                             "selective (Selective Context, the baseline) or random")] = "llmlingua",
    scorer: Annotated[str, typer.Option(help="the small model that scores tokens: zoo name or directory")]
        = "smollm2-135m",
    force: Annotated[Optional[list[str]], typer.Option(help="a string that must survive (repeat the option for "
                                                            "more)")] = None,
    keep_numbers: Annotated[bool, typer.Option(help="numbers always survive")] = True,
    keep_identifiers: Annotated[bool, typer.Option(help="code names (snake_case, camelCase, called names) always "
                                                        "survive")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print a JSON object: the text, token counts, ratio, "
                                                         "seconds")] = False,
) -> None:
    """Compress a long prompt by dropping the words a small model finds predictable (LLMLingua; with --question its
    units are ranked against the question, as LongLLMLingua does). Prints the compressed prompt; the ratio goes to
    stderr. Token counts are the scorer's."""
    if (text is None) == (file is None):
        _fail("give the prompt as TEXT or with --file, one of the two")
    if file is not None:
        if str(file) != "-" and not file.is_file():
            _fail(f"{file}: no such file")
        text = sys.stdin.read() if str(file) == "-" else file.read_text(errors="replace")
    result = PromptCompressor(scorer, progress=True).compress(
        text, question=question, instruction=instruction, rate=rate,
        target_tokens=target_tokens, method=method, force=tuple(force or ()), keep_numbers=keep_numbers,
        keep_identifiers=keep_identifiers)
    if as_json:
        out.print_json(json.dumps(result.to_dict()))
        return
    sys.stdout.write(result.text + ("" if result.text.endswith("\n") else "\n"))
    err.print(f"{result.original_tokens} -> {result.compressed_tokens} tokens ({result.ratio:.2f}x, "
              f"{result.method}) in {result.seconds:.2f} s")
