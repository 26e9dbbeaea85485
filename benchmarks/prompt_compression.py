"""Prompt compression: which compressor keeps the answer, how fast, and from what prompt length it pays.

    python benchmarks/prompt_compression.py [--tasks 16] [--context-tokens 1600] [--target qwen2.5-coder-1.5b]
                                            [--methods llmlingua,classifier,package:llmlingua,...] [--ratios 2,3,5]
                                            [--no-break-even]

Tasks from the project's own texts, the answer somewhere in a long context, scored as multiple choice (the
candidate the target finds most likely after the prompt, by mean log-probability per token, as evaluation
harnesses score choices):
- play: 'Who says "<line>"?' over a window of a play of the evaluation split (retrieval of a fact in a long
  document); the choices are the speakers in it.
- code: "What does the function F return?" over a window of a Python standard-library module, the function
  buried in it; the choices are the expressions its functions return.
Candidates are drawn until there are --tasks that the target answers right with the full prompt (half of each
kind), so accuracy is the share of answers that compression keeps.

Compressors, each at rate 1/ratio of the scorer's tokens and all with the same scorer (SmolLM2-135M):
- leanlm: llmlingua and longllmlingua (the iterative pass), classifier (one pass of the keep/drop classifier,
  prompt/classifier.py), selective (Selective Context), random; METHOD[:ITEM,...] passes compress options
  (llmlingua:adaptive, llmlingua:coarse=2). Numbers are not forced (the package has no such option; forced
  numbers took base64's tables over the budget), so that every method cuts to the same rate.
- the `llmlingua` package 0.2.2 (package:llmlingua, package:longllmlingua), run by benchmarks/prompt_compression_peer.py
  in its own environment (its docstring has the setup; PEER_PYTHON below) with its documented settings.
Each method (leanlm's and the package's) runs its first job once untimed before it is timed. Reported: the ratio
reached, accuracy, the answer's log-probability against the full prompt's, compression time
per 1k prompt tokens; then for each target (the 0.5B and the 1.5B) the break-even: compression time against the
prefill time it saves, at prompt lengths 256 to 2048, and the length from which compressing pays.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import random
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from leanlm.eval.datasets import EVALUATION_FILES, corpus_dir
from leanlm.generation.decode import prefill
from leanlm.generation.text import encode_prompt
from leanlm.models.loading import load
from leanlm.models.zoo import resolve
from leanlm.prompt.compressor import PromptCompressor

RATIOS = "2,3,5"
METHODS = "llmlingua,longllmlingua,classifier,package:llmlingua,package:longllmlingua,selective,random"
TARGETS = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")  # the break-even's; the accuracy's is --target
PEER_PYTHON = "/work/venvs/llmlingua/bin/python"  # llmlingua 0.2.2, transformers 4.46
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
            function = isinstance(node, ast.FunctionDef)
            returns = [r for r in ast.walk(node) if isinstance(r, ast.Return)] if function else []
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
        self.name = name
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


@dataclass
class Job:
    """One compression: the prompt's parts and the rate to cut it to."""

    instruction: str
    context: str
    question: str
    rate: float


class Compressors:
    """Runs a method over jobs: leanlm's in this process, the package's in its own environment (one process for
    all the jobs, its model loaded once). Each result: (compressed prompt, seconds of the compression alone)."""

    def __init__(self, scorer: PromptCompressor, threads: int):
        self.scorer, self.threads = scorer, threads

    def run(self, spec: str, jobs: list[Job]) -> list[tuple[str, float]]:
        if spec.startswith("package:"):
            return self._package(spec.partition(":")[2], jobs)
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
        def one(j: int, job: Job):
            c = self.scorer.compress(job.context, question=job.question, instruction=job.instruction, rate=job.rate,
                                     method=method, seed=j, keep_numbers=False, **extra)
            return c.text, c.seconds

        one(0, jobs[0])  # untimed, as the peer's first job: first-call costs out of both timings
        out = []
        for j, job in enumerate(jobs):
            wait_quiet()
            out.append(one(j, job))
        return out

    def _package(self, mode: str, jobs: list[Job]) -> list[tuple[str, float]]:
        wait_quiet()
        with tempfile.TemporaryDirectory() as tmp:
            tasks, out = Path(tmp) / "tasks.json", Path(tmp) / "out.json"
            tasks.write_text(json.dumps([asdict(j) for j in jobs]))
            subprocess.run([PEER_PYTHON, "-P", str(Path(__file__).with_name("prompt_compression_peer.py")),
                            str(resolve(self.scorer.name)), str(tasks), str(out), "--mode", mode,
                            "--threads", str(self.threads)], check=True, stdout=subprocess.DEVNULL)
            return [(r["text"], r["seconds"]) for r in json.loads(out.read_text())["results"]]


def full_prompt(job) -> str:
    return f"{job.instruction}\n\n{job.context.rstrip()}\n\n{job.question}"


def answerable(n: int, chars: int, target: Target, rng: random.Random) -> list[Task]:
    """`n` tasks (half play, half code) that the target answers right with the full prompt."""
    out = []
    for kind, make, want in (("play", play_tasks, n - n // 2), ("code", code_tasks, n // 2)):
        tried = right = 0
        for task in make(6 * want, chars, rng):
            if right == want:
                break
            wait_quiet()
            scores, _, _ = target.choose(full_prompt(task), task.choices)
            tried += 1
            if max(range(len(scores)), key=scores.__getitem__) == task.choices.index(task.answer):
                out.append(task)
                right += 1
        err.print(f"[dim]{kind}: the target answered {right} of {tried} candidates right with the full prompt[/]")
    return out


def accuracy(tasks: list[Task], compressors: Compressors, target: Target, methods: list[str],
             ratios: list[int]) -> None:
    count = compressors.scorer.count
    full = []
    for task in tasks:
        scores, _, _ = target.choose(full_prompt(task), task.choices)
        full.append(scores[task.choices.index(task.answer)])
    rows = {}  # (method, ratio) -> [(right, answer's log p - the full prompt's, seconds, tokens, kept tokens, kind)]
    pairs = list(itertools.product(range(len(tasks)), ratios))
    for method in methods:
        jobs = [Job(tasks[t].instruction, tasks[t].context.rstrip(), tasks[t].question, 1 / r) for t, r in pairs]
        for (t, ratio), job, (text, seconds) in zip(pairs, jobs, compressors.run(method, jobs)):
            task = tasks[t]
            wait_quiet()
            scores, _, _ = target.choose(text, task.choices)
            truth = task.choices.index(task.answer)
            rows.setdefault((method, ratio), []).append((
                max(range(len(scores)), key=scores.__getitem__) == truth, scores[truth] - full[t], seconds,
                count(full_prompt(job)), count(text), task.kind))
        err.print(f"[dim]{method}: done[/]")
    kinds = sorted({t.kind for t in tasks})
    table = Table(title=f"{len(tasks)} tasks the target answers right in full "
                        f"({', '.join(f'{sum(t.kind == k for t in tasks)} {k}' for k in kinds)}), ~"
                        f"{sum(r[3] for r in next(iter(rows.values()))) // len(tasks)} scorer tokens each; accuracy "
                        f"as multiple choice (chance ~{sum(1 / len(t.choices) for t in tasks) / len(tasks):.0%})")
    for col in ("method", "ratio", "ratio reached", "accuracy", *(f"{k} accuracy" for k in kinds),
                "answer log p vs full (± s.e.)", "compress s / 1k tokens"):
        table.add_column(col, justify="right")
    for (method, ratio), r in rows.items():
        mean = lambda i, rs=r: sum(x[i] for x in rs) / len(rs)  # noqa: E731
        se = statistics.stdev(x[1] for x in r) / len(r) ** 0.5 if len(r) > 1 else 0.0  # the tasks vary a lot
        table.add_row(method, f"{ratio}x", f"{sum(x[3] for x in r) / sum(x[4] for x in r):.2f}x", f"{mean(0):.0%}",
                      *(f"{mean(0, [x for x in r if x[5] == k]):.0%}" for k in kinds), f"{mean(1):+.2f} ± {se:.2f}",
                      f"{sum(x[2] for x in r) / sum(x[3] for x in r) * 1000:.3f}")
    Console(width=220).print(table)


def break_even(compressors: Compressors, targets: list[Target], methods: list[str], ratios: list[int],
               rng: random.Random) -> None:
    """Compression time against the prefill time it saves, by prompt length, for each target."""
    lengths = (256, 512, 1024, 2048)
    task = play_tasks(1, 4 * 2048 * 5, rng)[0]
    ids = targets[0].tok.encode(task.context)
    contexts = {n: targets[0].tok.decode(ids[:n]) for n in lengths}
    spent = {}  # (method, ratio) -> [(compress s, compressed prompt)] by length
    for method in [m for m in methods if m != "random"]:  # random costs nothing
        jobs = [Job("", contexts[n], task.question, 1 / r) for r in ratios for n in lengths]
        done = compressors.run(method, jobs)
        for i, ratio in enumerate(ratios):
            spent[method, ratio] = done[i * len(lengths):(i + 1) * len(lengths)]
    for target in targets:
        wait_quiet()
        full = {n: target.prefill_seconds(contexts[n] + "\n\n" + task.question) for n in lengths}
        prefills = ", ".join(f"{full[n]:.2f}" for n in lengths)
        table = Table(title=f"break-even for {target.name}: compress s / target prefill s saved, by prompt length "
                            f"(target tokens; the full prompt's prefill {prefills} s)")
        for col in ("method", "ratio", *[f"{n} tok" for n in lengths], "pays from"):
            table.add_column(col, justify="right")
        for (method, ratio), runs in spent.items():
            cells, net = [], []
            for n, (text, seconds) in zip(lengths, runs):
                wait_quiet()
                saved = full[n] - target.prefill_seconds(text)
                cells.append(f"{seconds:.2f} / {saved:.2f}")
                net.append(saved - seconds)
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
    ap.add_argument("--tasks", type=int, default=16, help="tasks the target answers right in full, half play and "
                    "half code (0: the break-even only)")
    ap.add_argument("--context-tokens", type=int, default=1600, help="about this many tokens of context a task")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b", help="the answering model")
    ap.add_argument("--scorer", default="smollm2-135m", help="the compressing model")
    ap.add_argument("--methods", default=METHODS, help="leanlm's METHOD[:ITEM,...] (an item: the quotas, even or "
                    "adaptive, or NAME=NUMBER, a numeric option of compress) or package:llmlingua|longllmlingua")
    ap.add_argument("--ratios", default=RATIOS)
    ap.add_argument("--no-break-even", action="store_true", help="skip the break-even tables")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    wait_quiet()
    rng = random.Random(0)
    methods, ratios = args.methods.split(","), [int(r) for r in args.ratios.split(",")]
    compressors = Compressors(PromptCompressor(args.scorer), args.threads)
    if "classifier" in [m.partition(":")[0] for m in methods]:
        compressors.scorer.classifier  # made (or read from the cache) before anything is timed
    target = Target(args.target)
    target.prefill_seconds("warm up")
    if args.tasks:
        tasks = answerable(args.tasks, args.context_tokens * 4, target, rng)  # ~4 characters a token
        accuracy(tasks, compressors, target, methods, ratios)
    if not args.no_break_even:
        targets = [target if name == args.target else Target(name) for name in TARGETS]
        for t in targets:
            t.prefill_seconds("warm up")
        break_even(compressors, targets, methods, ratios, rng)


if __name__ == "__main__":
    sys.exit(main())
