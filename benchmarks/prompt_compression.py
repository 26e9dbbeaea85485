"""Prompt compression: does the compressed prompt keep the answer, and from what length does compressing pay?

    python benchmarks/prompt_compression.py [--tasks 12] [--context-tokens 2048] [--target qwen2.5-coder-0.5b]

Tasks from the project's own texts, with the answer somewhere in a long context:
- play: 'Complete this line of the play: "<its first half>' over a window of a play of the evaluation split; right
  when the reply holds the next three words.
- code: "Complete the return statement of the function F: return" over a Python standard-library module; right
  when the reply holds the returned expression.
(Attribution questions, "who says <line>?", were tried first: qwen2.5-coder 0.5b and 1.5b got 0 of 4-5 right with
the full prompt, so they could not show what compression loses.)
The target model (greedy, its chat template) answers each with the full prompt, then with the prompt compressed
2x, 3x, 5x and 10x by LLMLingua (question-aware: LongLLMLingua), Selective Context and random token dropping, each
scored by the default zoo model. Reported: accuracy, agreement with the full-prompt answer, compression time, the
target's time to first token, end-to-end latency; then the break-even: compression time against the prefill time it
saves, at prompt lengths 256 to 4096, and the length from which compressing pays on this CPU.
"""

from __future__ import annotations

import argparse
import ast
import random
import re
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from leanlm.api import load
from leanlm.compress.prompt import PromptCompressor
from leanlm.eval.datasets import EVALUATION_FILES, corpus_dir
from leanlm.generation.decode import prefill
from leanlm.generation.sampling import SamplingParams
from leanlm.generation.text import encode_prompt, stream_rows

RATIOS = (2, 3, 5, 10)
METHODS = ("llmlingua", "selective", "random")
MODULES = ("textwrap", "shlex", "fnmatch", "posixpath", "calendar", "statistics", "base64", "heapq", "glob",
           "colorsys", "string", "bisect", "difflib", "ipaddress", "fractions", "tokenize")
PLAY_INSTRUCTION = "Read this excerpt of a play, then complete the line quoted after it as the play has it."
CODE_INSTRUCTION = "Read this Python module, then complete the line of code after it as the module has it."
err = Console(stderr=True)


@dataclass
class Task:
    kind: str
    instruction: str
    context: str
    question: str
    answer: str

    def correct(self, reply: str) -> bool:
        squash = lambda s: re.sub(r"[\s`'\"]", "", s).lower()  # noqa: E731
        return squash(self.answer) in squash(reply)


def play_tasks(n: int, chars: int, rng: random.Random) -> list[Task]:
    """'Complete this line: "<first half>' over `chars` characters of a play (cut at paragraph starts); the answer
    is the next three words."""
    tasks = []
    plays = [(corpus_dir() / f).read_text() for f in EVALUATION_FILES]
    while len(tasks) < n:
        text = rng.choice(plays)
        start = text.index("\n\n", rng.randrange(len(text) // 10, len(text) - chars)) + 2
        window = text[start:start + chars]
        window = window[:window.rindex("\n\n") + 2]
        lines = [line for line in window.splitlines() if len(line.split()) >= 8 and window.count(line) == 1
                 and not line.isupper() and "[" not in line]
        if lines:
            words = rng.choice(lines).split()
            cut = len(words) // 2
            tasks.append(Task("play", PLAY_INSTRUCTION, window, f'Complete this line of the play: "{" ".join(words[:cut])}',
                              " ".join(words[cut:cut + 3]).strip(",;:.!?")))
    return tasks


def code_tasks(n: int, chars: int, rng: random.Random) -> list[Task]:
    """'Complete the return statement of F' for a top-level function whose one return statement ends its body, in a window of
    `chars` characters of its module (whole lines) that holds the whole function."""
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
                    candidates.append((source, lines, node, expr))
    rng.shuffle(candidates)
    tasks = []
    for source, lines, node, expr in candidates:
        offset = lambda lineno: sum(len(x) for x in lines[:lineno - 1])  # noqa: E731
        fn_start, fn_end = offset(node.lineno), offset(node.end_lineno + 1)
        if fn_end - fn_start > chars // 3 or len(tasks) == n:
            continue
        begin = max(0, fn_start - rng.randrange(0, max(1, chars - (fn_end - fn_start))))
        begin = source.rfind("\n", 0, begin) + 1  # whole lines
        end = max(fn_end, source.rfind("\n", 0, begin + chars) + 1)
        tasks.append(Task("code", CODE_INSTRUCTION, source[begin:end],
                          f"Complete the return statement of the function {node.name}: return", expr))
    return tasks


class Target:
    """The answering model: greedy replies with their time to first token and end-to-end time."""

    def __init__(self, name: str, max_tokens: int):
        self.net, self.tok = load(name, progress=True)
        self.params = SamplingParams(temperature=0, max_tokens=max_tokens)

    def answer(self, prompt: str) -> tuple[str, float, float, int]:
        """(reply, TTFT s, end-to-end s, prompt tokens)"""
        start, first = time.perf_counter(), None
        messages = [{"role": "user", "content": prompt}]
        for item in stream_rows(self.net, self.tok, [messages], self.params, chat=True):
            if first is None:
                first = time.perf_counter() - start
            if isinstance(item, list):
                completion = item[0]
        return completion.text, first, time.perf_counter() - start, len(completion.prompt_tokens)

    def prefill_seconds(self, text: str) -> float:
        ids = encode_prompt(self.tok, [{"role": "user", "content": text}], True)
        start = time.perf_counter()
        with torch.inference_mode():
            prefill(self.net, [ids], 1)
        return time.perf_counter() - start


def wait_quiet() -> None:
    """Another job on these two cores asks for quiet while it measures (/tmp/leanlm-quiet)."""
    while Path("/tmp/leanlm-quiet").exists():
        time.sleep(5)


def full_prompt(task: Task) -> str:
    return f"{task.instruction}\n\n{task.context.rstrip()}\n\n{task.question}"


def accuracy(tasks: list[Task], scorer: PromptCompressor, target: Target) -> None:
    rows = {}  # (method, ratio) -> list of (correct, agrees, compress s, ttft, e2e, tokens)
    for t, task in enumerate(tasks):
        wait_quiet()
        full, ttft, e2e, tokens = target.answer(full_prompt(task))
        rows.setdefault(("full", 1), []).append((task.correct(full), True, 0.0, ttft, e2e, tokens))
        err.print(f"[dim]task {t + 1}/{len(tasks)} ({task.kind}, {tokens} tokens): full -> {full.strip()[:40]!r} "
                  f"(want {task.answer!r})[/]")
        for method in METHODS:
            for ratio in RATIOS:
                wait_quiet()
                c = scorer.compress(task.context.rstrip(), question=task.question, instruction=task.instruction,
                                    rate=1 / ratio, method=method, seed=t)
                reply, ttft, e2e, tokens = target.answer(c.text)
                rows.setdefault((method, ratio), []).append(
                    (task.correct(reply), reply.strip() == full.strip(), c.seconds, ttft, e2e + c.seconds, tokens))
    table = Table(title=f"answers of {len(tasks)} tasks ({', '.join(sorted({t.kind for t in tasks}))}), "
                        f"context ~{sum(r[5] for r in rows[('full', 1)]) // len(tasks)} target tokens")
    for col in ("method", "ratio", "prompt tokens", "accuracy", "agrees with full", "compress s", "TTFT s",
                "end-to-end s (with compression)"):
        table.add_column(col, justify="right")
    for (method, ratio), r in rows.items():
        mean = lambda i: sum(x[i] for x in r) / len(r)  # noqa: E731
        table.add_row(method, f"{ratio}x" if ratio > 1 else "-", f"{mean(5):.0f}", f"{mean(0):.0%}", f"{mean(1):.0%}",
                      f"{mean(2):.2f}", f"{mean(3):.2f}", f"{mean(4):.2f}")
    Console(width=200).print(table)


def break_even(scorer: PromptCompressor, target: Target, rng: random.Random) -> None:
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
    for method in ("llmlingua", "selective"):
        for ratio in (2, 5):
            cells, net = [], []
            for n in lengths:
                wait_quiet()
                c = scorer.compress(contexts[n], question=task.question, rate=1 / ratio, method=method)
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
    ap.add_argument("--tasks", type=int, default=12, help="tasks, half play and half code")
    ap.add_argument("--context-tokens", type=int, default=2048, help="about this many tokens of context a task")
    ap.add_argument("--target", default="qwen2.5-coder-0.5b", help="the answering model")
    ap.add_argument("--scorer", default="smollm2-135m", help="the compressing model")
    ap.add_argument("--max-tokens", type=int, default=24, help="reply tokens")
    ap.add_argument("--no-break-even", action="store_true", help="skip the break-even table")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    chars = args.context_tokens * 4  # English and Python run about 4 characters a token
    tasks = play_tasks(args.tasks - args.tasks // 2, chars, rng) + code_tasks(args.tasks // 2, chars, rng)
    scorer, target = PromptCompressor(args.scorer), Target(args.target, args.max_tokens)
    target.answer("warm up")
    accuracy(tasks, scorer, target)
    if not args.no_break_even:
        break_even(scorer, target, rng)


if __name__ == "__main__":
    sys.exit(main())
