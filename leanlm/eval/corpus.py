"""A teacher-written corpus on disk (JSONL, one `Example` a line, as `leanlm distill-data` writes it) and as training
text (`corpus_text`: what `--data CORPUS.jsonl` reads)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from leanlm.errors import LeanLMError


@dataclass
class Example:
    """One corpus document. prompt: text, or chat messages ([{"role", "content"}, ...]) for a chat prompt; score:
    the teacher's mean log-probability per token of the completion (feedback), else None."""

    prompt: str | list[dict]
    completion: str
    source: str
    score: float | None = None


def write_corpus(path: str | Path, examples: list[Example]) -> None:
    """Write `examples` as JSONL, atomically: a failure leaves no partial file behind."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for example in examples:
                f.write(json.dumps(asdict(example), ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _json_lines(path: Path):
    """(where, object) for each non-blank line of a JSONL file; errors name the line."""
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise LeanLMError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                yield f"{path}, line {number}", json.loads(line)
            except json.JSONDecodeError as e:
                raise LeanLMError(f"{path}, line {number}: not JSON ({e.msg})") from None


def _prompt(where: str, item) -> str | list[dict]:
    """The prompt of a JSONL object: "prompt" (text or messages) or "messages"."""
    prompt = item.get("prompt", item.get("messages")) if isinstance(item, dict) else None
    is_chat = isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "content" in m for m in prompt)
    if not (isinstance(prompt, str) and prompt.strip() or is_chat):
        raise LeanLMError(f'{where}: give "prompt" (text) or "messages" (a list of {{"role", "content"}})')
    return prompt


def read_corpus(path: str | Path) -> list[Example]:
    """A corpus written by `write_corpus` (or by hand: "prompt" and "completion" are enough)."""
    path, examples = Path(path), []
    for where, item in _json_lines(path):
        prompt = _prompt(where, item)
        if not isinstance(item.get("completion"), str):
            raise LeanLMError(f'{where}: no "completion" (text)')
        examples.append(Example(prompt, item["completion"], str(item.get("source", "")), item.get("score")))
    if not examples:
        raise LeanLMError(f"{path}: no examples (one JSON object a line)")
    return examples


def read_items(path: str | Path) -> list[str | list[dict]]:
    """Prompts, examples or topics: .jsonl lines with "prompt" or "messages", else one item per non-blank line."""
    path = Path(path)
    if not path.is_file():
        raise LeanLMError(f"{path}: no such file")
    if path.suffix.lower() == ".jsonl":
        items = [_prompt(where, item) for where, item in _json_lines(path)]
    else:
        try:
            items = [line.strip() for line in path.read_text(encoding="utf-8-sig").splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise LeanLMError(f"{path}: cannot read as UTF-8 text ({getattr(e, 'strerror', None) or e})") from None
    if not items:
        raise LeanLMError(f"{path}: empty (one item a line, or JSONL with \"prompt\" or \"messages\")")
    return items


def render(example: Example, tokenizer=None) -> str:
    """One training document: prompt + completion, or for a chat prompt the whole chat in the tokenizer's template."""
    if isinstance(example.prompt, str):
        return example.prompt + example.completion
    if tokenizer is None:
        raise LeanLMError("a corpus of chat prompts is rendered with the model's chat template: pass its tokenizer")
    turn = {"role": "assistant", "content": example.completion}
    return tokenizer.apply_chat_template([*example.prompt, turn], add_generation_prompt=False)


def corpus_text(path: str | Path, tokenizer=None) -> str:
    """A corpus file as training text: its documents joined by the EOS token's text (a blank line without one)."""
    sep = getattr(tokenizer, "eos_token", None) or "\n\n"
    return sep.join(render(example, tokenizer) for example in read_corpus(path))
