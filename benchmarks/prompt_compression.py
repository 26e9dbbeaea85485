"""Prompt compression: does the compressed prompt keep the answer, and from what length does compressing pay?

    python benchmarks/prompt_compression.py [--tasks 12] [--context-tokens 2048] [--target qwen2.5-coder-0.5b]
                                            [--methods llmlingua,llmlingua:adaptive,...] [--ratios 2,3,5,10]

Tasks from the project's own texts, with the answer somewhere in a long context, scored as multiple choice (the
candidate the target finds most likely after the prompt, by mean log-probability per token, as evaluation
harnesses score choices):
- play: 'Who says "<line>"?' over a window of a play of the evaluation split; the choices are the speakers in it.
- code: "What does the function F return?" over a window of a Python standard-library module; the choices are the
  expressions its functions return.
(Generated answers were tried first: qwen2.5-coder 0.5b and 1.5b named the speaker 0 times in 4-5 with the full
prompt, and line completion, which they could do half the time, is lost by dropping any token of the line.)
The target (its chat template) reads each prompt in full, then compressed 2x, 3x, 5x and 10x by LLMLingua
(each segment its even share as the paper does, and adaptive quotas), LongLLMLingua, Selective Context and random
token dropping, each scored by the default zoo model. Reported:
accuracy, the answer's log-probability against the full prompt's, compression time and the target's prefill; then
the break-even: compression time against the prefill time it saves at prompt lengths 256 to 4096.
"""

from __future__ import annotations

import argparse
import ast
import random
import re
import statistics
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from leanlm.models.loading import load
from leanlm.prompt.compressor import PromptCompressor
from leanlm.eval.datasets import EVALUATION_FILES, corpus_dir
from leanlm.generation.decode import prefill
from leanlm.generation.text import encode_prompt

RATIOS = "2,3,5,10"
METHODS = "llmlingua,llmlingua:adaptive,longllmlingua,selective,random"  # METHOD[:ITEM,...] (see compress)
MODULES = ("textwrap", "shlex", "fnmatch", "posixpath", "calendar", "statistics", "base64", "heapq", "glob",
           "colorsys", "string", "bisect", "difflib", "ipaddress", "fractions", "tokenize")
PLAY_INSTRUCTION = "Read this excerpt of a play, then answer the question after it with the speaker's name."
CODE_INSTRUCTION = "Read this Python code, then answer the question after it with the returned expression."
SPEAKER = re.compile(r"^([A-Z][A-Z .']+)\.\n(?:\[.*?\]\s*)?([^\n\[]+)", re.M)
err = Console(stderr=True)


@dataclass
class Task:
    kind: str
    instruction: str
    context: str
    question: str
    answer: str
    choices: list[str]


def play_tasks(n: int, chars: int, rng: random.Random) -> list[Task]:
    """'Who says "<first line of a speech>"?' over `chars` characters of a play (cut at paragraph starts)."""
    tasks = []
    plays = [(corpus_dir() / f).read_text() for f in EVALUATION_FILES]
    while len(tasks) < n:
        text = rng.choice(plays)
        start = text.index("\n\n", rng.randrange(len(text) // 10, len(text) - chars)) + 2
        window = text[start:start + chars]
        window = window[:window.rindex("\n\n") + 2]
        speakers = sorted({m.group(1).strip() for m in SPEAKER.finditer(window)})
        speeches = [m for m in SPEAKER.finditer(window)
                    if len(m.group(2).split()) >= 5 and window.count(m.group(2)) == 1 and "ALL" not in m.group(1)]
        if speeches and len(speakers) >= 3:
            m = rng.choice(speeches)
            tasks.append(Task("play", PLAY_INSTRUCTION, window, f'Who says "{m.group(2).strip()}"?',
                              m.group(1).strip(), speakers))
    return tasks


def code_tasks(n: int, chars: int, rng: random.Random) -> list[Task]:
    """'What does F return?' for a top-level function whose one return statement ends its body, in a window of
    `chars` characters of its module (whole lines) that holds the whole function; the choices are what the
    functions in the window return."""
    candidates = []
    for name in MODULES:
        source = (Path(sysconfig.get_paths()["stdlib"]) / f"{name}.py").read_text()
        tree = ast.parse(source)
        lines = source.splitlines(keepends=True)
        for node in tree.body:
            returns = [r for r in ast.walk(node) if isinstance(r, ast.Return)] if isinstance(node, ast.FunctionDef) else []
            if len(returns) == 1 and returns[0] is node.body[-1] and returns[0].value is not None:
                expr = ast.get_source_segment(source, returns[0].value)
                if 6 <= len(expr) <= 60 and "\n" not in expr and not node.name.startswith("_"):
                    candidates.append((source, tree, lines, node, expr))
    rng.shuffle(candidates)
    tasks = []
    for source, tree, lines, node, expr in candidates:
        offset = lambda lineno: sum(len(x) for x in lines[:lineno - 1])  # noqa: E731
        fn_start, fn_end = offset(node.lineno), offset(node.end_lineno + 1)
        if fn_end - fn_start > chars // 3 or len(tasks) == n:
            continue
        begin = max(0, fn_start - rng.randrange(0, max(1, chars - (fn_end - fn_start))))
        begin = source.rfind("\n", 0, begin) + 1  # whole lines
        end = max(fn_end, source.rfind("\n", 0, begin + chars) + 1)
        choices = sorted({ast.get_source_segment(source, r.value) for r in ast.walk(tree)
                          if isinstance(r, ast.Return) and r.value is not None
                          and begin <= offset(r.lineno) < end and r.lineno == r.end_lineno})
        if len(choices) >= 3:
            tasks.append(Task("code", CODE_INSTRUCTION, source[begin:end],
                              f"What does the function {node.name} return?", expr, choices))
    return tasks


class Target:
    """The answering model: which choice it finds most likely after a prompt, and how long its prefill took."""

    def __init__(self, name: str):
        self.net, self.tok = load(name, progress=True)

    def ids(self, prompt: str) -> list[int]:
        return encode_prompt(self.tok, [{"role": "user", "content": prompt}], True)

    @torch.inference_mode()
    def choose(self, prompt: str, choices: list[str]) -> tuple[list[float], float, int]:
        """(mean log-probability per token of each choice as the reply, prefill seconds, prompt tokens)"""
        ids = self.ids(prompt)
        encoded = [self.tok.encode(c, add_special_tokens=False) for c in choices]
        start = time.perf_counter()
        last, cache = prefill(self.net, [ids], max(len(c) for c in encoded))
        seconds = time.perf_counter() - start
        scores = []
        for c in encoded:
            cache.truncate(len(ids))
            logits = [last[0]]
            if len(c) > 1:
                positions = torch.arange(len(ids), len(ids) + len(c) - 1)[None]
                logits += list(self.net(torch.tensor([c[:-1]]), positions, cache)[0])
            logp = torch.log_softmax(torch.stack(logits).float(), -1)
            scores.append(logp[torch.arange(len(c)), torch.tensor(c)].mean().item())
        return scores, seconds, len(ids)

    def prefill_seconds(self, text: str) -> float:
        ids = self.ids(text)
        start = time.perf_counter()
        with torch.inference_mode():
            prefill(self.net, [ids], 1)
        return time.perf_counter() - start


def wait_quiet() -> None:
    """Another job on these two cores asks for quiet while it measures (/tmp/leanlm-quiet)."""
    while Path("/tmp/leanlm-quiet").exists():
        time.sleep(5)


def compress(scorer: PromptCompressor, spec: str, *args, **options):
    """PromptCompressor.compress by a benchmark method name: METHOD[:ITEM,...], an item the quotas (even or adaptive)
    or NAME=NUMBER, one of compress's numeric options (e.g. llmlingua:adaptive, llmlingua:coarse=1.5)."""
    method, _, items = spec.partition(":")
    extra = {"quotas": "even"}
    for item in filter(None, items.split(",")):
        name, eq, value = item.partition("=")
        if eq:
            extra[name] = int(value) if value.isdigit() else float(value)
        elif name in ("even", "adaptive"):
            extra["quotas"] = name
        else:
            sys.exit(f"unknown item {item!r} in the method {spec!r}")
    return scorer.compress(*args, method=method, **extra, **options)


def accuracy(tasks: list[Task], scorer: PromptCompressor, target: Target, methods: list[str],
             ratios: list[int]) -> None:
    rows = {}  # (method, ratio) -> [(right, answer's log p - the full prompt's, compress s, prefill s, tokens, kind)]
    for t, task in enumerate(tasks):
        truth = task.choices.index(task.answer)
        prompts = [("full", 1, f"{task.instruction}\n\n{task.context.rstrip()}\n\n{task.question}", 0.0)]
        for method in methods:
            for ratio in ratios:
                wait_quiet()
                c = compress(scorer, method, task.context.rstrip(), question=task.question,
                             instruction=task.instruction, rate=1 / ratio, seed=t)
                prompts.append((method, ratio, c.text, c.seconds))
        for method, ratio, prompt, seconds in prompts:
            wait_quiet()
            scores, prefill_s, tokens = target.choose(prompt, task.choices)
            if method == "full":
                base = scores[truth]
            right = max(range(len(scores)), key=scores.__getitem__) == truth
            rows.setdefault((method, ratio), []).append((right, scores[truth] - base, seconds, prefill_s, tokens,
                                                         task.kind))
        err.print(f"[dim]task {t + 1}/{len(tasks)} ({task.kind}, {rows[('full', 1)][-1][4]} tokens, "
                  f"{len(task.choices)} choices): full {'right' if rows[('full', 1)][-1][0] else 'wrong'}[/]")
    kinds = sorted({t.kind for t in tasks})
    table = Table(title=f"{len(tasks)} tasks ({', '.join(f'{sum(t.kind == k for t in tasks)} {k}' for k in kinds)}), "
                        f"context ~{sum(r[4] for r in rows[('full', 1)]) // len(tasks)} target tokens; accuracy as "
                        f"multiple choice (chance ~{sum(1 / len(t.choices) for t in tasks) / len(tasks):.0%})")
    for col in ("method", "ratio", "prompt tokens", "accuracy", *(f"{k} accuracy" for k in kinds),
                "answer log p vs full (± s.e.)", "compress s", "target prefill s", "compress + prefill s"):
        table.add_column(col, justify="right")
    for (method, ratio), r in rows.items():
        mean = lambda i, rs=r: sum(x[i] for x in rs) / len(rs)  # noqa: E731
        by_kind = [mean(0, [x for x in r if x[5] == k]) for k in kinds]
        se = statistics.stdev(x[1] for x in r) / len(r) ** 0.5 if len(r) > 1 else 0.0  # the tasks vary a lot
        table.add_row(method, f"{ratio}x" if ratio > 1 else "-", f"{mean(4):.0f}", f"{mean(0):.0%}",
                      *(f"{a:.0%}" for a in by_kind), f"{mean(1):+.2f} ± {se:.2f}", f"{mean(2):.2f}", f"{mean(3):.2f}",
                      f"{mean(2) + mean(3):.2f}")
    Console(width=220).print(table)


def break_even(scorer: PromptCompressor, target: Target, rng: random.Random, methods: list[str]) -> None:
    """Compression time against the prefill time it saves, by prompt length: from where does compressing pay?"""
    lengths = (256, 512, 1024, 2048, 4096)
    table = Table(title="break-even: compression time vs the target prefill time it saves (question-aware where the "
                        "method uses the question)")
    for col in ("method", "ratio", *[f"{n} tok: compress / saved s" for n in lengths], "pays from"):
        table.add_column(col, justify="right")
    task = play_tasks(1, 4 * 4096 * 5, rng)[0]
    ids = target.tok.encode(task.context)
    contexts = {n: target.tok.decode(ids[:n]) for n in lengths}
    full = {n: target.prefill_seconds(contexts[n] + "\n\n" + task.question) for n in lengths}
    for method in [m for m in methods if m.partition(":")[0] in ("llmlingua", "longllmlingua", "selective")]:
        for ratio in (2, 5):
            cells, net = [], []
            for n in lengths:
                wait_quiet()
                c = compress(scorer, method, contexts[n], question=task.question, rate=1 / ratio)
                saved = full[n] - target.prefill_seconds(c.text)
                cells.append(f"{c.seconds:.2f} / {saved:.2f}")
                net.append(saved - c.seconds)
            table.add_row(method, f"{ratio}x", *cells, _crossing(lengths, net))
    Console(width=220).print(table)


def _crossing(lengths, net: list[float]) -> str:
    """The length where saved - spent turns positive (linear between measured lengths)."""
    if all(x <= 0 for x in net):
        return f"does not pay up to {lengths[-1]}"
    if net[0] > 0:
        return f"pays at {lengths[0]}"
    for (a, x), (b, y) in zip(zip(lengths, net), zip(lengths[1:], net[1:])):
        if x <= 0 < y:
            return f"~{a + (b - a) * -x / (y - x):.0f} tokens"
    return "mixed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=12, help="tasks, half play and half code (0: the break-even only)")
    ap.add_argument("--context-tokens", type=int, default=2048, help="about this many tokens of context a task")
    ap.add_argument("--target", default="qwen2.5-coder-0.5b", help="the answering model")
    ap.add_argument("--scorer", default="smollm2-135m", help="the compressing model")
    ap.add_argument("--methods", default=METHODS, help="METHOD[:ITEM,...]: an item is the quotas (even, the default, "
                    "or adaptive) or NAME=NUMBER, a numeric option of compress (coarse=1.5, segment=100)")
    ap.add_argument("--ratios", default=RATIOS)
    ap.add_argument("--no-break-even", action="store_true", help="skip the break-even table")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    wait_quiet()
    rng = random.Random(0)
    chars = args.context_tokens * 4  # English and Python run about 4 characters a token
    tasks = play_tasks(args.tasks - args.tasks // 2, chars, rng) + code_tasks(args.tasks // 2, chars, rng)
    scorer, target = PromptCompressor(args.scorer), Target(args.target)
    target.prefill_seconds("warm up")
    methods = args.methods.split(",")
    if tasks:
        accuracy(tasks, scorer, target, methods, [int(r) for r in args.ratios.split(",")])
    if not args.no_break_even:
        break_even(scorer, target, rng, methods)


if __name__ == "__main__":
    sys.exit(main())
