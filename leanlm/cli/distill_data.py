"""`leanlm distill-data`: a teacher writes a distillation corpus (JSONL of prompt/completion pairs) for
`leanlm distill --data`, by labelling prompts, expanding examples, curating topics or judging a student's samples."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from leanlm.cli.common import DType, Threads, _fail, app, err, out
from leanlm.distillation import data
from leanlm.engine import LLM
from leanlm.eval.corpus import read_items, write_corpus
from leanlm.generation.sampling import SamplingParams

Items = "one item a line (.txt), or JSONL with {\"prompt\": ...} or {\"messages\": [...]} a line"


def _check(mode: str, given: dict, numbers: dict, temperature: float | None, output: Path) -> None:
    """Fail on options that belong to another mode, numbers out of range and an output that cannot be written."""
    owners = {"count": "expand", "shots": "expand", "per_topic": "curate", "template": "curate", "student": "feedback",
              "samples": "feedback", "correct": "feedback", "tau": "feedback"}
    for name, value in given.items():
        if value not in (None, False) and owners[name] != mode:
            _fail(f"--{name.replace('_', '-')} goes with --{owners[name]}, not --{mode}")
    for name, need in {"expand": "count", "curate": "per_topic", "feedback": "student"}.items():
        if mode == name and given[need] is None:
            _fail(f"--{mode} needs --{need.replace('_', '-')}")
    if given["tau"] is not None and not given["correct"]:
        _fail("--tau goes with --correct")
    for name, value in numbers.items():
        if value is not None and value < 1:
            _fail(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if given["tau"] is not None and not 0 < given["tau"] <= 1:
        _fail(f"--tau is a probability in (0, 1], got {given['tau']}")
    if temperature is not None and (temperature < 0 or (temperature == 0 and mode != "label")):
        _fail(f"--temperature must be {'>= 0' if mode == 'label' else 'above 0 (this text is sampled)'}, "
              f"got {temperature}")
    if output.exists():
        _fail(f"{output} already exists; choose a new file")
    if not output.parent.is_dir():
        _fail(f"{output.parent}: no such folder for the output")


def _texts(path: Path, what: str) -> list[str]:
    items = read_items(path)
    if not all(isinstance(item, str) for item in items):
        _fail(f"{path}: {what} are text, one a line (or JSONL with {{\"prompt\": \"...\"}}), not chats")
    return items


@app.command("distill-data")
def distill_data(
    teacher: Annotated[str, typer.Argument(help="the teacher: zoo name or model directory")],
    output: Annotated[Path, typer.Option("--output", "-o", help="corpus to write: JSONL, one {prompt, completion, "
                                                                "source, score} a line")],
    label_file: Annotated[Optional[Path], typer.Option("--label", help=f"PROMPTS for the teacher to complete ({Items})")] = None,
    expand_file: Annotated[Optional[Path], typer.Option("--expand", help="EXAMPLES: the teacher writes --count new "
                                                        "prompts like them, then completes them")] = None,
    count: Annotated[Optional[int], typer.Option(help="with --expand: new prompts to write")] = None,
    shots: Annotated[Optional[int], typer.Option(help="with --expand: examples shown per request (default 3)")] = None,
    curate_file: Annotated[Optional[Path], typer.Option("--curate", help="TOPICS: the teacher writes --per-topic "
                                                        "prompts about each, then completes them")] = None,
    per_topic: Annotated[Optional[int], typer.Option(help="with --curate: prompts per topic")] = None,
    template: Annotated[Optional[str], typer.Option(help="with --curate: the request for a prompt, {topic} filled "
                                                         "in; the reply's first paragraph is the prompt")] = None,
    feedback_file: Annotated[Optional[Path], typer.Option("--feedback", help="PROMPTS: the student samples "
                                                          "completions and the teacher keeps the one it finds most "
                                                          "likely (mean log-probability per token)")] = None,
    student: Annotated[Optional[str], typer.Option(help="with --feedback: the student (same tokenizer)")] = None,
    samples: Annotated[Optional[int], typer.Option(help="with --feedback: student samples per prompt (default 4)")] = None,
    correct: Annotated[bool, typer.Option(help="with --feedback: the teacher takes over each sample at its first "
                                               "token below probability --tau and finishes it greedily")] = False,
    tau: Annotated[Optional[float], typer.Option(help="with --correct: the probability threshold (default 0.1)")] = None,
    max_tokens: Annotated[int, typer.Option(help="most new tokens per completion (and per new prompt)")] = 128,
    temperature: Annotated[Optional[float], typer.Option(help="sampling temperature of new prompts (--expand, "
                                                              "--curate) and student samples (--feedback), default "
                                                              "1.0; of --label's completions, default 0 (greedy). "
                                                              "The teacher completes new prompts greedily")] = None,
    seed: Annotated[int, typer.Option(help="random seed: the same seed writes the same corpus")] = 0,
    chat: Annotated[bool, typer.Option(help="prompts go through the models' chat template (and are saved as chats)")] = False,
    dtype: DType = "auto", threads: Threads = None,
) -> None:
    """Write a distillation corpus with TEACHER for `leanlm distill --data CORPUS.jsonl`: label a prompt set, expand
    a few examples, curate a topic list, or score (with --correct, correct) a student's samples. Give one of --label,
    --expand, --curate, --feedback."""
    modes = {"label": label_file, "expand": expand_file, "curate": curate_file, "feedback": feedback_file}
    chosen = [name for name, path in modes.items() if path is not None]
    if len(chosen) != 1:
        _fail("give one of --label PROMPTS, --expand EXAMPLES, --curate TOPICS or --feedback PROMPTS")
    mode, source = chosen[0], modes[chosen[0]]
    _check(mode, dict(count=count, shots=shots, per_topic=per_topic, template=template, student=student,
                      samples=samples, correct=correct, tau=tau),
           dict(count=count, shots=shots, per_topic=per_topic, samples=samples, max_tokens=max_tokens), temperature,
           output)
    what = {"expand": "examples", "curate": "topics"}.get(mode)
    items = _texts(source, what) if what else read_items(source)
    sampled = SamplingParams(temperature=1.0 if temperature is None else temperature, max_tokens=max_tokens)
    labels = SamplingParams(temperature=temperature if mode == "label" and temperature is not None else 0.0,
                            max_tokens=max_tokens, seed=seed)
    llm = LLM(teacher, dtype=dtype, threads=threads)
    if mode == "feedback":
        student_llm = LLM(student, dtype=dtype, threads=threads)
        if not llm.engine.tokenizer.same_vocabulary(student_llm.engine.tokenizer):
            _fail(f"{student} does not share {teacher}'s tokenizer; the teacher can only score the student's tokens "
                  "with the same vocabulary")
        err.print(f"{len(items)} prompts: the student samples {samples or 4} completions each, the teacher "
                  f"{'corrects and ' if correct else ''}scores them", soft_wrap=True)
        examples = data.feedback(llm, student_llm, items, samples or 4, sampled, seed, chat, correct,
                                 0.1 if tau is None else tau, progress=True)
        mean = sum(e.score for e in examples) / len(examples)
        note = f"best of {samples or 4} student samples{', corrected' if correct else ''}, mean score {mean:.3f}"
    else:
        prompts, note = items, f"{len(items)} prompts"
        if mode == "expand":
            err.print(f"writing {count} new prompts in the style of {len(items)} examples", soft_wrap=True)
            prompts = data.expand(llm, items, count, sampled, seed, shots or 3, chat, progress=True)
            note = f"{len(prompts)} new prompts from {len(items)} examples"
            if len(prompts) < count:
                err.print(f"only {len(prompts)} distinct new prompts of the {count} asked for (repeats dropped)",
                          soft_wrap=True)
        elif mode == "curate":
            err.print(f"writing {per_topic} prompts about each of {len(items)} topics", soft_wrap=True)
            prompts = data.curate(llm, items, per_topic, sampled, seed, template or data.CURATE_TEMPLATE, chat,
                                  progress=True)
            note = f"{len(prompts)} prompts about {len(items)} topics"
        if not prompts:
            _fail("the teacher wrote no usable prompt; try a higher --temperature, more --max-tokens or other examples")
        err.print(f"the teacher completes {len(prompts)} prompts", soft_wrap=True)
        examples = data.label(llm, prompts, labels, chat, source=mode, progress=True)
    write_corpus(output, examples)
    out.print(f"{len(examples)} examples -> {output} ({mode}: {note})", highlight=False, soft_wrap=True)
