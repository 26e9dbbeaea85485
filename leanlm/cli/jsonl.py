"""Prompt files for `leanlm generate --file` and `leanlm bench --prompts`: one JSON object per line, results
written the same way. File handling for the CLI, so it lives here, not in the engine."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from leanlm.errors import LeanLMError
from leanlm.generation.grammar import GrammarSpec
from leanlm.generation.sampling import SamplingParams

FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} - {"grammar"}
GRAMMAR_FIELDS = ("json_schema", "json_object", "regex", "choice", "grammar")  # structured outputs, one per line


def read_requests(path: Path, defaults: SamplingParams) -> tuple[list, list[SamplingParams]]:
    """Each line: {"prompt": "..."} or {"messages": [...]} (a chat), plus any SamplingParams field to override
    the defaults for that line (e.g. "max_tokens": 32) and at most one structured-output constraint ("json_schema":
    {...}, "json_object": true, "regex", "choice": [...] or "grammar"). Returns (prompts, params); errors name the
    line."""
    prompts, params = [], []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise LeanLMError(f"{path}: cannot read the prompt file ({e.strerror})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise LeanLMError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(item, dict) or ("prompt" in item) == ("messages" in item):
            raise LeanLMError(f"{where}: give an object with either \"prompt\" (text) or \"messages\" (a chat)")
        unknown = set(item) - FIELDS - set(GRAMMAR_FIELDS) - {"prompt", "messages"}
        if unknown:
            raise LeanLMError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; "
                              f"sampling fields are {', '.join(sorted(FIELDS))}; structured outputs "
                              f"{', '.join(GRAMMAR_FIELDS)}")
        overrides = {k: v for k, v in item.items() if k in FIELDS}
        try:
            if spec := GrammarSpec.one_of(**{k: item[k] for k in GRAMMAR_FIELDS if k in item}):
                overrides["grammar"] = spec
            params.append(dataclasses.replace(defaults, **overrides) if overrides else defaults)
        except (LeanLMError, TypeError) as e:
            raise LeanLMError(f"{where}: {e}") from None
        prompts.append(item.get("prompt", item.get("messages")))
    if not prompts:
        raise LeanLMError(f"{path}: no prompts (one JSON object per line)")
    return prompts, params


def result_line(index: int, output) -> str:
    """One engine.RequestOutput as a JSON line: its completions' texts, finish reasons and token counts."""
    completions = [{"text": c.text, "finish_reason": c.finish_reason, "tokens": len(c.token_ids)}
                   for c in output.outputs]
    return json.dumps({"index": index, "prompt_tokens": len(output.prompt_token_ids), "completions": completions})
