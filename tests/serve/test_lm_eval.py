"""lm-eval-harness's `local-completions` backend against `leanlm serve` scores a multiple-choice task as lm-eval's own
`hf` backend does on the same weights: per-choice loglikelihoods (the echoed prompt's logprobs), answers, accuracy.

The task is generated at test time from the built-in evaluation text (no hub, no data file in the repo): the first
lines of a speech, and which of four lines comes next (the true one, or the same line of three other speeches)."""

import json
import random
import re

import pytest

from leanlm.bench.serve import LocalServer
from leanlm.eval.datasets import builtin_text
from leanlm.models.zoo import DEFAULT_MODEL, pull

pytestmark = pytest.mark.real_model
lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm-eval's `hf` backend
pytest.importorskip("tenacity")  # and its API ones: lm-eval[hf,api]

TASK = "leanlm_next_line"
N_ITEMS = 40
CONTEXT_LINES = 3
TOL = 1e-3  # float32 on both sides: only the kernels' rounding differs
_SPEAKER = re.compile(r"^[A-Z][A-Z .'-]+\.$")  # "LE BEAU." opens a speech


def next_line_items(text: str, n: int, seed: int = 0) -> list[dict]:
    """`n` items: a speaker and the first CONTEXT_LINES lines of a speech; the choices, its next line and that line of
    three other speeches, in a seeded order."""
    speeches = []
    for block in text.split("\n\n"):
        lines = block.split("\n")
        body = lines[1:CONTEXT_LINES + 2]
        if _SPEAKER.match(lines[0]) and len(body) == CONTEXT_LINES + 1 and all(len(x) > 8 for x in body):
            speeches.append((lines[0], body))
    rng = random.Random(seed)
    picked = rng.sample(range(len(speeches)), n)
    items = []
    for i in picked:
        speaker, body = speeches[i]
        distractors = []
        while len(distractors) < 3:
            line = speeches[rng.randrange(len(speeches))][1][CONTEXT_LINES]
            if line != body[CONTEXT_LINES] and line not in distractors:
                distractors.append(line)
        choices = [body[CONTEXT_LINES], *distractors]
        rng.shuffle(choices)
        items.append({"context": "\n".join([speaker, *body[:CONTEXT_LINES]]) + "\n", "choices": choices,
                      "label": choices.index(body[CONTEXT_LINES])})
    return items


@pytest.fixture(scope="module")
def model_dir():
    return pull(DEFAULT_MODEL, progress=False)


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    """A TaskManager that knows only the generated task (a YAML and its JSONL in a temporary folder)."""
    from lm_eval.tasks import TaskManager

    folder = tmp_path_factory.mktemp("lm_eval_task")
    data = folder / "items.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in next_line_items(builtin_text("evaluation"), N_ITEMS)))
    config = {"task": TASK, "dataset_path": "json", "test_split": "test", "output_type": "multiple_choice",
              "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(folder / "hf_datasets")},
              "doc_to_text": "{{context}}", "doc_to_choice": "choices", "doc_to_target": "label",
              "target_delimiter": "", "metric_list": [{"metric": "acc"}]}
    (folder / f"{TASK}.yaml").write_text(json.dumps(config, indent=1))  # JSON is YAML
    return TaskManager(include_path=str(folder), include_defaults=False)


def evaluate(task_manager, model: str, model_args: str, **kwargs):
    """(accuracy, {doc_id: [(loglikelihood, is_greedy) of each choice]}, {doc_id: label}) of one lm-eval run."""
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], task_manager=task_manager,
                                  log_samples=True, bootstrap_iters=0, **kwargs)
    samples = out["samples"][TASK]
    lls = {s["doc_id"]: [(float(ll), bool(greedy)) for ll, greedy in s["filtered_resps"]] for s in samples}
    labels = {s["doc_id"]: int(s["target"]) for s in samples}
    return out["results"][TASK]["acc,none"], lls, labels


@pytest.fixture(scope="module")
def hf_run(task_manager, model_dir):
    return evaluate(task_manager, "hf", f"pretrained={model_dir},dtype=float32", device="cpu", batch_size=8)


@pytest.fixture(scope="module")
def server(model_dir):
    # the served name is the directory's (never its path): what lm-eval sends as `model`
    serve_args = ["--dtype", "float32", "--threads", "1", "--kv-cache-memory", "256MiB"]
    srv = LocalServer.leanlm(str(model_dir), model_dir.name, serve_args, timeout=300)
    with srv:
        yield srv


@pytest.mark.parametrize("tokenized", [True, False], ids=["token-ids", "text"])
def test_local_completions_scores_like_hf(hf_run, server, task_manager, model_dir, tokenized):
    hf_acc, hf, labels = hf_run
    args = (f"model={model_dir.name},base_url={server.url}/v1/completions,tokenizer={model_dir},"
            f"tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,tokenized_requests={tokenized}")
    api_acc, api, api_labels = evaluate(task_manager, "local-completions", args)
    assert api_labels == labels and len(labels) == N_ITEMS
    hf_lls = {d: [ll for ll, _ in hf[d]] for d in labels}
    api_lls = {d: [ll for ll, _ in api[d]] for d in labels}
    diff = max(abs(a - b) for d in labels for a, b in zip(api_lls[d], hf_lls[d], strict=True))
    ties = sum(1 for d in labels if abs(sorted(hf_lls[d])[-1] - sorted(hf_lls[d])[-2]) <= 2 * TOL)
    print(f"\n{'token ids' if tokenized else 'text'}: accuracy hf {hf_acc:.4f}, local-completions {api_acc:.4f}, "
          f"max |loglikelihood difference| {diff:.2e}, {ties} near-ties")
    assert diff < TOL
    for d in labels:
        top2 = sorted(hf_lls[d])[-2:]
        if top2[1] - top2[0] > 2 * TOL:  # a float tie may go either way
            assert max(range(4), key=api_lls[d].__getitem__) == max(range(4), key=hf_lls[d].__getitem__), d
    assert abs(api_acc - hf_acc) * N_ITEMS <= ties + 1e-9  # equal unless a tie went the other way
    # is_greedy (from the echoed top_logprobs) as `hf` computes it from its logits
    assert [g for d in labels for _, g in api[d]] == [g for d in labels for _, g in hf[d]]
    assert hf_acc >= 1.5 / 4  # a sanity check on the task: 19 of 40 right, against 10 by chance
