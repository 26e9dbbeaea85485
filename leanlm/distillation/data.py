"""Black-box distillation data: a corpus of (prompt, completion) pairs written by a teacher through the engine.

The four ways of the KD survey (Xu et al., arXiv 2402.13116, "knowledge elicitation"): `label` (the teacher
completes a prompt set), `expand` (new prompts in the style of a few examples), `curate` (prompts about each topic
of a list), `feedback` (the teacher scores, or corrects, the student's own samples). The corpus they write, on
disk and as training text, is eval.corpus.
"""

from __future__ import annotations

import random
import re
from dataclasses import replace

import torch

from leanlm.errors import LeanLMError
from leanlm.eval.corpus import Example
from leanlm.generation.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
EXPAND_HEADER = "Here are some examples. Write one more: new, different from them, in the same style.\n\n"
CURATE_TEMPLATE = "Write one new question or task about {topic}, as a user would ask it.\nTask:"


# --- the teacher labels, expands and curates ----------------------------------------------------------------------

def _stored(prompt, chat: bool):
    """A prompt as the corpus keeps it: a chat prompt as messages, so that rendering knows it is one."""
    return [{"role": "user", "content": prompt}] if chat and isinstance(prompt, str) else prompt


def label(llm, prompts: list, params: SamplingParams | None = None, chat: bool = False, source: str = "label",
          progress: bool = False) -> list[Example]:
    """The teacher completes every prompt (greedy unless `params` say otherwise), all batched by the engine.
    With greedy labels this is sequence-level KD (Kim & Rush, arXiv 1606.07947)."""
    outputs = llm.generate(list(prompts), params or GREEDY, chat=chat, progress=progress)
    return [Example(_stored(p, chat), o.outputs[0].text, source) for p, o in zip(prompts, outputs)]


def parse_item(text: str, marker: str) -> str:
    """The one item of a generated reply: a leading "MARKER N:" label dropped, cut at the next such label."""
    label_re = rf"{re.escape(marker)}\s*\d*\s*:"
    text = re.sub(rf"^\s*{label_re}", "", text)
    return re.split(rf"\n\s*{label_re}", text)[0].strip()


def fewshot_prompt(examples: list[str], marker: str = "Example") -> str:
    """Examples numbered "MARKER 1:", ..., then the label of the next one for the teacher to write."""
    shots = "".join(f"{marker} {i}:\n{ex.strip()}\n\n" for i, ex in enumerate(examples, 1))
    return f"{EXPAND_HEADER}{shots}{marker} {len(examples) + 1}:\n"


def _sample_items(llm, wants: list[int], prompt_for, params: SamplingParams, seed: int, seen: set[str],
                  marker: str, chat: bool, progress: bool, rounds: int = 4) -> list[list[str]]:
    """For each slot i, up to wants[i] distinct new items, one parsed from each sampled reply to prompt_for(i, rng);
    items in `seen` (and exact repeats) are dropped and asked for again, for at most `rounds` rounds."""
    if params.greedy:
        raise LeanLMError("new prompts are sampled: give a temperature above 0")
    rng, got = random.Random(seed), [[] for _ in wants]
    params = replace(params, n=1, stop=(*params.stop, f"\n{marker}"))
    for _ in range(rounds):
        asks = [i for i, want in enumerate(wants) for _ in range(want - len(got[i]))]
        if not asks:
            break
        prompts = [prompt_for(i, rng) for i in asks]
        per_ask = [replace(params, seed=rng.randrange(2**31)) for _ in asks]  # deterministic whatever the batch
        for i, output in zip(asks, llm.generate(prompts, per_ask, chat=chat, progress=progress)):
            item = parse_item(output.outputs[0].text, marker)
            if item and item not in seen and len(got[i]) < wants[i]:
                seen.add(item)
                got[i].append(item)
    return got


def expand(llm, examples: list[str], count: int, params: SamplingParams, seed: int = 0, shots: int = 3,
           chat: bool = False, progress: bool = False) -> list[str]:
    """Up to `count` new prompts in the style of `examples` (Self-Instruct, arXiv 2212.10560): each from a few-shot
    prompt of a random `shots` of them; copies of the examples and repeats are dropped."""
    seeds = [e.strip() for e in examples]
    pick = lambda i, rng: fewshot_prompt(rng.sample(seeds, min(shots, len(seeds))))  # noqa: E731
    return _sample_items(llm, [count], pick, params, seed, set(seeds), "Example", chat, progress)[0]


def curate(llm, topics: list[str], per_topic: int, params: SamplingParams, seed: int = 0,
           template: str = CURATE_TEMPLATE, chat: bool = False, progress: bool = False) -> list[str]:
    """Up to `per_topic` distinct prompts the teacher writes about each topic, from `template` with {topic} filled
    in (UltraChat's topic-to-question step, arXiv 2305.14233); the reply's first paragraph is the prompt."""
    if "{topic}" not in template:
        raise LeanLMError(f"the curation template must contain {{topic}}, got {template!r}")
    params = replace(params, stop=(*params.stop, "\n\n"))
    ask = lambda i, rng: template.replace("{topic}", topics[i])  # noqa: E731
    got = _sample_items(llm, [per_topic] * len(topics), ask, params, seed, set(), "Task", chat, progress)
    return [item for items in got for item in items]


# --- feedback: the teacher scores or corrects the student's samples -----------------------------------------------

def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, t] | ids[:, :t]) for t >= 1; column 0 (no context) is 0  # [B, T, V], [B, T] -> [B, T] float32"""
    picked = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(picked, (1, 0))


def _completion_mask(ids: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    t = torch.arange(ids.shape[1], device=ids.device)
    return (t >= starts[:, None]) & (t < (starts + lengths)[:, None])  # [B, T]


def mean_logprob(logits: torch.Tensor, ids: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each row's mean log-probability per token of its completion ids[b, starts[b] : starts[b] + lengths[b]]
    (starts >= 1, after the prompt); -inf for an empty one  # [B, T, V], [B, T], [B], [B] -> [B]"""
    total = (token_logprobs(logits, ids) * _completion_mask(ids, starts, lengths)).sum(-1)
    return torch.where(lengths > 0, total / lengths.clamp_min(1), float("-inf"))


def first_below(logits: torch.Tensor, ids: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                tau: float) -> torch.Tensor:
    """Each row's first completion token (counted from the completion's start) whose probability is below tau;
    the completion's length where none is  # [B, T, V], [B, T], [B], [B] -> [B] int64"""
    below = _completion_mask(ids, starts, lengths) & (token_logprobs(logits, ids).exp() < tau)
    return torch.where(below.any(-1), below.long().argmax(-1) - starts, lengths)


def _batches(lengths: list[int], tokens: int):
    """Consecutive (start, end) ranges whose padded size (rows x the longest) stays within `tokens` (>= 1 row)."""
    start, longest = 0, 0
    for i, n in enumerate(lengths):
        if i > start and (i + 1 - start) * max(longest, n) > tokens:
            yield start, i
            start, longest = i, 0
        longest = max(longest, n)
    if lengths:
        yield start, len(lengths)


@torch.inference_mode()
def per_row(model, rows: list[tuple[list[int], list[int]]], fn, budget: int = 1 << 28) -> list:
    """fn(logits, ids, starts, lengths) -> [B] over batched forwards of (prompt ids, completion ids) rows, one value
    a row. Rows are right-padded (causal: padding after a row changes nothing before it); a batch's logits stay
    within `budget` bytes."""
    values = []
    for i, j in _batches([len(p) + len(c) for p, c in rows], max(1, budget // (4 * model.config.vocab_size))):
        longest = max(len(p) + len(c) for p, c in rows[i:j])
        ids = torch.zeros(j - i, longest, dtype=torch.long)
        for b, (prompt, completion) in enumerate(rows[i:j]):
            ids[b, : len(prompt) + len(completion)] = torch.tensor(prompt + completion)
        starts = torch.tensor([len(p) for p, _ in rows[i:j]])
        lengths = torch.tensor([len(c) for _, c in rows[i:j]])
        ids, positions = ids.to(model.device), torch.arange(longest, device=model.device).expand_as(ids)
        values += fn(model(ids, positions), ids, starts.to(ids.device), lengths.to(ids.device)).tolist()
    return values


def _take_over(teacher, rows, tau: float, params: SamplingParams, progress: bool):
    """Each row with the teacher taking over, greedily for the rest of max_tokens, at its first completion token
    whose teacher probability is below tau (rows without one stay as they are)."""
    cuts = per_row(teacher.engine.model, rows, lambda *args: first_below(*args, tau))
    todo = [i for i, ((_, completion), cut) in enumerate(zip(rows, cuts)) if cut < len(completion)]
    greedy = [SamplingParams(temperature=0.0, max_tokens=params.max_tokens - cuts[i], ignore_eos=params.ignore_eos,
                             stop_token_ids=params.stop_token_ids) for i in todo]
    heads = [rows[i][0] + rows[i][1][: cuts[i]] for i in todo]
    rows = list(rows)
    for i, output in zip(todo, teacher.generate(heads, greedy, progress=progress) if todo else []):
        rows[i] = (rows[i][0], rows[i][1][: cuts[i]] + output.outputs[0].token_ids)
    return rows


def student_samples(student, prompts: list, samples: int, params: SamplingParams, seed: int = 0, chat: bool = False,
                    progress: bool = False) -> list[list[tuple[list[int], list[int]]]]:
    """`samples` completions of each prompt by the student: per prompt, [(prompt ids, completion ids)] * samples."""
    rng = random.Random(seed)
    per_prompt = [replace(params, n=samples, seed=rng.randrange(2**31)) for _ in prompts]
    outputs = student.generate(list(prompts), per_prompt, chat=chat, progress=progress)
    return [[(o.prompt_token_ids, c.token_ids) for c in o.outputs] for o in outputs]


def feedback(teacher, student, prompts: list, samples: int = 4, params: SamplingParams | None = None, seed: int = 0,
             chat: bool = False, correct: bool = False, tau: float = 0.1, progress: bool = False) -> list[Example]:
    """Per prompt, the student's best of `samples` completions by the teacher's mean log-probability per token (the
    score kept). With `correct`, each sample is first taken over by the teacher at its first token below probability
    tau (like SKD's teacher replacing the student's poorly ranked tokens, arXiv 2410.11325, but the teacher then
    finishes greedily), and the corrected samples are scored."""
    if not teacher.engine.tokenizer.same_vocabulary(student.engine.tokenizer):
        raise LeanLMError("the teacher and the student have different tokenizers; feedback needs the same vocabulary")
    if samples < 1 or not 0 < tau <= 1:
        raise LeanLMError(f"samples must be >= 1 and tau in (0, 1], got {samples} and {tau}")
    params = params or SamplingParams(temperature=1.0)
    rows = [row for rows in student_samples(student, prompts, samples, params, seed, chat, progress) for row in rows]
    if correct:
        rows = _take_over(teacher, rows, tau, params, progress)
    scores = per_row(teacher.engine.model, rows, mean_logprob)
    examples, tok = [], teacher.engine.tokenizer
    for i, prompt in enumerate(prompts):
        best = max(range(i * samples, (i + 1) * samples), key=scores.__getitem__)
        examples.append(Example(_stored(prompt, chat), tok.decode(rows[best][1]),
                                "feedback+correct" if correct else "feedback", scores[best]))
    return examples
