"""Black-box distillation data: the teacher labels, expands, curates and judges through the engine; the scoring
against a naive loop; the corpus on disk and as `leanlm distill --data` text; the verb's bad input in one line."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from leanlm.distillation import data
from leanlm.eval import corpus
from leanlm.eval.corpus import Example
from leanlm.errors import LeanLMError
from leanlm.generation.sampling import SamplingParams
from tests.conftest import make_hf_model, make_tokenizer
from tests.test_cli import leanlm

PROMPTS = ["the quick brown fox", "hello world", "def f(x):"]


def _model_dir(path, seed, vocab=120):
    make_hf_model("llama", path, seed=seed)
    make_tokenizer(path, vocab)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(teacher, student) model directories: two random tiny models of one tokenizer."""
    return (_model_dir(tmp_path_factory.mktemp("teacher"), 0), _model_dir(tmp_path_factory.mktemp("student"), 1))


@pytest.fixture(scope="module")
def llms(dirs):
    from leanlm.engine import LLM

    return tuple(LLM(d, dtype="float32", threads=1, kv_cache_memory="8MiB", quiet=True) for d in dirs)


def _naive_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """Teacher log-probability of each completion token, one unpadded forward and a per-token loop."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1])[None])[0]
    return [logits[t - 1].log_softmax(-1)[ids[0, t]].item() for t in range(len(prompt), ids.shape[1])]


def test_scoring_and_the_first_low_token_equal_a_naive_loop():
    torch.manual_seed(0)
    logits, ids = torch.randn(3, 7, 11), torch.randint(0, 11, (3, 7))
    starts, lengths = torch.tensor([1, 3, 2]), torch.tensor([6, 2, 0])
    scores = data.mean_logprob(logits, ids, starts, lengths)
    tau = 0.09
    cuts = data.first_below(logits, ids, starts, lengths, tau)
    for b in range(3):
        lp = [logits[b, t - 1].log_softmax(-1)[ids[b, t]].item() for t in range(starts[b], starts[b] + lengths[b])]
        expected = sum(lp) / len(lp) if lp else float("-inf")
        assert scores[b].item() == pytest.approx(expected, abs=1e-6)
        below = [i for i, x in enumerate(lp) if torch.tensor(x).exp() < tau]
        assert cuts[b].item() == (below[0] if below else len(lp))
    assert 0 < cuts[0] < 6  # the case where the cut falls inside a completion is exercised


def test_batched_padded_scoring_equals_one_row_at_a_time(llms):
    """Rows of different lengths, split into several padded batches by a small budget."""
    model = llms[0].engine.model
    rows = [([1, 5, 9], [7, 8, 2]), ([1, 4], [10, 11, 12, 13, 14]), ([1, 6, 6, 6, 6], [3]), ([1], [20, 21])]
    scores = data.per_row(model, rows, data.mean_logprob, budget=4 * 128 * 12)  # 12 tokens a batch
    naive = [sum(lp) / len(lp) for lp in (_naive_logprobs(model, p, c) for p, c in rows)]
    assert scores == pytest.approx(naive, abs=1e-5)
    assert list(data._batches([6, 7, 6, 3], 12)) == [(0, 1), (1, 2), (2, 4)]


def test_label_is_the_teachers_greedy_completion(llms):
    from leanlm.generation.text import generate

    llm, params = llms[0], SamplingParams(temperature=0.0, max_tokens=8)
    examples = data.label(llm, PROMPTS, params)
    static = generate(llm.engine.model, llm.engine.tokenizer, PROMPTS, params)  # another decoder: static batch
    assert [e.completion for e in examples] == [o.outputs[0].text for o in llm.generate(PROMPTS, params, progress=False)]
    assert [e.completion for e in examples] == [c.text for c in static]
    assert {e.source for e in examples} == {"label"} and all(e.score is None for e in examples)
    chats = data.label(llm, PROMPTS[:1], params, chat=True)  # a chat prompt is kept as messages
    assert chats[0].prompt == [{"role": "user", "content": PROMPTS[0]}]
    assert chats[0].completion == llm.generate(PROMPTS[:1], params, chat=True, progress=False)[0].outputs[0].text


class ScriptedLLM:
    """Stands in for the teacher: each generate call answers with the next scripted texts."""

    def __init__(self, *rounds):
        self.rounds, self.calls = list(rounds), []

    def generate(self, prompts, params, chat=False, progress=False):
        self.calls.append((prompts, params))
        texts = self.rounds.pop(0)
        assert len(texts) == len(prompts)
        return [SimpleNamespace(outputs=[SimpleNamespace(text=t)]) for t in texts]


def test_expand_drops_repeats_and_copies_of_the_examples_and_asks_again():
    seeds = ["add two numbers", "reverse a string", "sort a list", "count words"]
    llm = ScriptedLLM(["Example 4:\nparse a date\nExample 5:\nmore", "sort a list", "parse a date"],
                      ["  ", "merge two dicts"],
                      ["Example 3: reverse a string"], ["Example 4: find the max"])
    got = data.expand(llm, seeds, 3, SamplingParams(temperature=0.8, max_tokens=16), seed=5)
    assert got == ["parse a date", "merge two dicts", "find the max"]
    assert [len(prompts) for prompts, _ in llm.calls] == [3, 2, 1, 1]
    for prompts, params in llm.calls:
        assert len({p.seed for p in params}) == len(params) and all("\nExample" in p.stop for p in params)
        for prompt in prompts:  # three of the examples, then the label of the one to write
            assert prompt.endswith("Example 4:\n") and sum(s in prompt for s in seeds) == 3
    assert data.parse_item("Task: sum a list\n\nTask 2: more", "Task") == "sum a list"
    with pytest.raises(LeanLMError, match="temperature"):
        data.expand(llm, seeds, 1, SamplingParams(temperature=0.0))


def test_expand_and_curate_are_deterministic_for_a_seed(llms):
    llm, params = llms[0], SamplingParams(temperature=1.0, max_tokens=6)
    seeds = ["the quick brown fox", "hello there world", "jumps over the dog"]
    first = data.expand(llm, seeds, 3, params, seed=1)
    assert first == data.expand(llm, seeds, 3, params, seed=1) and len(first) == 3
    assert first != data.expand(llm, seeds, 3, params, seed=2)
    assert not set(first) & set(seeds) and len(set(first)) == 3
    topics = ["foxes", "dogs"]
    curated = data.curate(llm, topics, 2, params, seed=1, template="Tell me about {topic}.\nTask:")
    assert curated == data.curate(llm, topics, 2, params, seed=1, template="Tell me about {topic}.\nTask:")
    assert len(curated) == 4 and len(set(curated)) == 4
    with pytest.raises(LeanLMError, match="topic"):
        data.curate(llm, topics, 1, params, template="no placeholder")


def test_feedback_keeps_the_sample_the_teacher_scores_highest(llms):
    teacher, student = llms
    params = SamplingParams(temperature=1.0, max_tokens=6)
    examples = data.feedback(teacher, student, PROMPTS[:2], samples=3, params=params, seed=3)
    samples = data.student_samples(student, PROMPTS[:2], 3, params, seed=3)  # the same seed: the same samples
    tok = teacher.engine.tokenizer
    for example, rows in zip(examples, samples):
        scores = [sum(lp) / len(lp) for lp in (_naive_logprobs(teacher.engine.model, p, c) for p, c in rows)]
        best = max(range(3), key=scores.__getitem__)
        assert max(scores) > min(scores)  # the choice matters
        assert example.completion == tok.decode(rows[best][1]) and example.score == pytest.approx(scores[best], abs=1e-5)
        assert example.source == "feedback"
    assert examples == data.feedback(teacher, student, PROMPTS[:2], samples=3, params=params, seed=3)


def test_correct_keeps_the_student_up_to_the_first_unlikely_token_then_the_teachers_greedy_tokens(llms):
    teacher, student = llms
    model, n = teacher.engine.model, 10
    params = SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True)
    [[(prompt, sample)]] = data.student_samples(student, PROMPTS[:1], 1, params, seed=0)
    probs = [torch.tensor(lp).exp().item() for lp in _naive_logprobs(model, prompt, sample)]
    # tau between the first token that is less likely than every one before it and the least likely before it
    cut = next(j for j in range(1, n) if probs[j] < min(probs[:j]))
    tau = (probs[cut] + min(probs[:cut])) / 2
    [example] = data.feedback(teacher, student, PROMPTS[:1], samples=1, params=params, seed=0, correct=True, tau=tau)
    ids = prompt + sample[:cut]
    with torch.no_grad():
        while len(ids) < len(prompt) + n:  # the teacher's greedy continuation, recomputed from scratch each token
            ids.append(model(torch.tensor([ids]), torch.arange(len(ids))[None])[0, -1].argmax().item())
    tok = teacher.engine.tokenizer
    assert ids[len(prompt) + cut :] != sample[cut:]  # the teacher did change the rest
    assert example.completion == tok.decode(ids[len(prompt) :]) and example.source == "feedback+correct"
    lp = _naive_logprobs(model, prompt, ids[len(prompt) :])
    assert example.score == pytest.approx(sum(lp) / len(lp), abs=1e-5)


def test_the_corpus_round_trips_and_renders_as_training_text(tmp_path, dirs):
    from leanlm.eval.datasets import load_text
    from leanlm.tokenizer import Tokenizer

    examples = [Example("hello", " world", "label"), Example([{"role": "user", "content": "héllo"}], "hi", "feedback", -1.5)]
    path = tmp_path / "corpus.jsonl"
    corpus.write_corpus(path, examples)
    assert corpus.read_corpus(path) == examples
    tok = Tokenizer(dirs[0])
    chat = "<s>user: héllo</s><s>assistant: hi</s>"
    assert corpus.corpus_text(path, tok) == load_text(path, tokenizer=tok) == "hello world</s>" + chat
    with pytest.raises(LeanLMError, match="chat template"):
        load_text(path)  # a chat corpus needs the tokenizer
    corpus.write_corpus(path, examples[:1])
    assert load_text(path) == "hello world"  # no chats, no tokenizer: plain documents
    (tmp_path / "plain.txt").write_text("plain text\n")
    assert load_text(tmp_path / "plain.txt") == "plain text\n" and load_text(tmp_path) == "plain text"
    with pytest.raises(TypeError):  # a failed write leaves the old corpus and no temporary file
        corpus.write_corpus(path, [Example("a", "b", "label", score=object())])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "plain.txt"]
    assert corpus.read_corpus(path) == examples[:1]


def test_the_verb_writes_a_corpus_that_distill_trains_on(dirs, tmp_path):
    teacher, student = dirs
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS) + json.dumps(
        {"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    written = tmp_path / "corpus.jsonl"
    r = leanlm("distill-data", teacher, "--feedback", prompts, "--student", student, "--samples", "2", "--correct",
               "--tau", "0.05", "--max-tokens", "8", "--dtype", "float32", "--threads", "1", "-o", written)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines() == [r.stdout.strip()] and "4 examples" in r.stdout
    examples = corpus.read_corpus(written)
    assert len(examples) == 4 and all(e.source == "feedback+correct" and e.score < 0 for e in examples)
    assert isinstance(examples[3].prompt, list)
    r = leanlm("distill", "--teacher", teacher, "--student", student, "--data", written, "--steps", "2", "--batch-size",
               "2", "--seq-len", "16", "--eval-tokens", "64", "-o", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "out" / "distill.json").read_text())["history"]["steps"] == [0, 1]


def test_bad_input_is_one_clear_line_and_writes_nothing(dirs, tmp_path, monkeypatch, capsys):
    """Run in this process through the CLI's own entry point (what `leanlm` runs): an uncaught error would raise."""
    from leanlm.cli import main

    teacher, _ = dirs
    other = _model_dir(tmp_path / "other", 2, vocab=60)  # another tokenizer
    empty, prompts = tmp_path / "empty.txt", tmp_path / "prompts.txt"
    empty.write_text("\n  \n")
    prompts.write_text("hello\n")
    out = tmp_path / "corpus.jsonl"
    capsys.readouterr()  # what making the models printed
    cases = {("--label", tmp_path / "missing.txt"): "no such file",
             ("--label", empty): "empty",
             ("--feedback", prompts, "--student", other): "tokenizer",
             ("--expand", prompts, "--count", "0"): "--count must be at least 1",
             ("--feedback", prompts, "--student", teacher, "--correct", "--tau", "1.5"): "--tau",
             ("--label", prompts, "--curate", prompts): "give one of",
             ("--label", prompts, "--per-topic", "2"): "--per-topic goes with --curate"}
    for args, message in cases.items():
        monkeypatch.setattr("sys.argv", ["leanlm", "distill-data", str(teacher), *map(str, args), "--threads", "1",
                                         "-o", str(out)])
        with pytest.raises(SystemExit) as exit:
            main()
        captured = capsys.readouterr()
        assert exit.value.code == 2 and message in captured.err, (args, captured.err)
        lines = captured.err.strip().splitlines()  # the error, after the engines' one-line descriptions if they loaded
        assert lines[-1].startswith("error:") and all(line.startswith("leanlm: ") for line in lines[:-1]), captured.err
        assert not out.exists() and captured.out == ""
