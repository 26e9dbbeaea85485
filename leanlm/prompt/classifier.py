"""One-pass prompt compression (LLMLingua-2, Pan et al., arXiv 2403.12968): a token classifier reads the prompt
once and gives each token a keep probability, instead of the iterative pass's scorer runs (~3 forward passes of all
its layers and its vocabulary-wide head).

The classifier is the first `layers` decoder layers of the scorer, attending both ways (each token sees the words
after it too), then a norm and a linear head: one keep logit a token. It reads the prompt in windows of `window`
tokens (its training length; the cost stays linear in the prompt). Its embedding is the scorer's, shared and frozen.

leanlm trains it on labels it makes itself (`Recipe`): windows of the calibration text (plays and poems, never the
evaluation split) and of Python's standard library (other modules than the benchmark's) go through the iterative
LLMLingua pass at rates 1/2, 1/3 and 1/5; a token's target is the share of those rates that kept it, so the
classifier learns an order over tokens and one model serves every rate. Made on first use and cached under
cache_dir()/prompt-classifiers/ (a few minutes on 2 cores, progress on stderr); the recipe is this file, so
deleting the folder re-makes the same model.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from safetensors.torch import load_file, save_file
from torch import nn

from leanlm.eval.datasets import builtin_text
from leanlm.fetch import atomic_dir, cache_dir

# Standard-library modules the training windows come from; benchmarks/prompt_compression.py asks about others.
CODE_MODULES = ("argparse", "ast", "configparser", "csv", "dataclasses", "enum", "functools", "gettext", "inspect",
                "json/decoder", "json/encoder", "logging/__init__", "optparse", "pathlib", "pprint", "pydoc",
                "random", "subprocess", "tarfile", "threading", "typing", "unittest/case", "urllib/parse", "zipfile")


@dataclass(frozen=True)
class Recipe:
    """How the classifier is made; its digest names the cached model."""

    layers: int = 4
    window: int = 512  # tokens a training window (and an inference window) holds
    prose_windows: int = 96
    code_windows: int = 64
    rates: tuple[float, ...] = (1 / 2, 1 / 3, 1 / 5)  # the iterative pass's rates that make the labels
    epochs: int = 5
    batch: int = 8
    lr: float = 3e-3
    seed: int = 0

    def digest(self, net) -> str:
        """The recipe's and the scorer's (a sample of its embedding: two models under one name differ)."""
        sample = net.embed_tokens.weight[::max(1, net.config.vocab_size // 64)].float().cpu().numpy().tobytes()
        return hashlib.sha256(json.dumps(dataclasses.asdict(self)).encode() + sample).hexdigest()[:12]


class KeepClassifier(nn.Module):
    """The first `layers` layers of `net`, attending both ways, and a keep/drop head."""

    def __init__(self, net, layers: int, window: int):
        super().__init__()
        self.embed, self.rope, self.window = net.embed_tokens.forward, net.rope, window  # the scorer's, not copies
        self.layers = nn.ModuleList(copy.deepcopy(net.layers[i]) for i in range(layers))
        self.norm = copy.deepcopy(net.norm)
        self.head = nn.Linear(net.config.hidden_size, 1, dtype=net.dtype, device=net.device)
        nn.init.zeros_(self.head.weight)  # every token starts at 1/2 (the norm's outputs are large: a random head
        nn.init.zeros_(self.head.bias)  # began far off and learned little in a few hundred steps)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Keep logits  # tokens [B, T] -> [B, T]"""
        x = self.embed(tokens).to(self.head.weight.dtype)
        cos, sin = (t.to(x.dtype) for t in self.rope(torch.arange(tokens.shape[1], device=tokens.device)[None]))
        for block in self.layers:
            x = block(x, cos, sin, None, None, False)
        return self.head(self.norm(x)).squeeze(-1)

    @torch.inference_mode()
    def keep_probability(self, ids: list[int]) -> torch.Tensor:
        """Each token's keep probability, the prompt read in windows (the full ones in one batch)  # [n] -> [n]"""
        full = len(ids) // self.window * self.window
        device = self.head.weight.device
        out = []
        if full:
            out.append(self(torch.tensor(ids[:full], device=device).view(-1, self.window)).flatten())
        if full < len(ids):
            out.append(self(torch.tensor([ids[full:]], device=device))[0])
        return torch.cat(out).float().sigmoid().cpu()


def classifier_dir(compressor, recipe: Recipe) -> Path:
    return cache_dir() / "prompt-classifiers" / f"{Path(compressor.name).name}-{recipe.digest(compressor.net)}"


def load_classifier(compressor, recipe: Recipe = Recipe(), progress: bool = True) -> KeepClassifier:
    """The compressor's classifier: from the cache, or trained now and cached."""
    folder = classifier_dir(compressor, recipe)
    model = KeepClassifier(compressor.net, recipe.layers, recipe.window)
    if not (folder / "model.safetensors").exists():
        start = time.perf_counter()
        state = train(compressor, recipe, progress)
        with atomic_dir(folder) as tmp:
            save_file(state, tmp / "model.safetensors")
            (tmp / "recipe.json").write_text(json.dumps({"scorer": compressor.name, **dataclasses.asdict(recipe)}))
        if progress:
            Console(file=sys.stderr).print(f"prompt classifier: made in {time.perf_counter() - start:.0f} s, "
                                           f"cached in {folder}")
    state = load_file(folder / "model.safetensors", device=str(compressor.net.device))
    model.load_state_dict({k: v.to(compressor.net.dtype) for k, v in state.items()})
    return model.eval().requires_grad_(False)


# ---- the recipe -------------------------------------------------------------------------------------------------

def training_texts(recipe: Recipe, chars: int, rng: random.Random) -> list[str]:
    """Windows of about `chars` characters, cut at blank lines: the calibration split's prose, then Python."""
    prose = builtin_text("calibration")
    code = [(Path(sysconfig.get_paths()["stdlib"]) / f"{m}.py").read_text() for m in CODE_MODULES]
    out = []
    for n, pick in ((recipe.prose_windows, lambda: prose), (recipe.code_windows, lambda: rng.choice(code))):
        while n:
            text = pick()
            if len(text) < 2 * chars:
                continue
            start = text.find("\n\n", rng.randrange(0, len(text) - 2 * chars)) + 2
            window = text[start:start + chars]
            window = window[:window.rfind("\n\n")]
            if len(window) > chars // 2:
                out.append(window)
                n -= 1
    return out


def labels(compressor, texts: list[str], rates, bar=None) -> list[tuple[list[int], torch.Tensor]]:
    """Each text's token ids and target: the share of `rates` at which the iterative pass kept each token (its
    units and the tokens of each as `decide` splits them, so that training reads what inference reads)."""
    out = []
    for text in texts:
        kept = [compressor.decide(text, rate=r, coarse=0, method="llmlingua") for r in rates]
        out.append((kept[0].ids, torch.stack([d.keep for d in kept]).float().mean(0)))
        if bar:
            bar()
    return out


def train(compressor, recipe: Recipe, progress: bool = True) -> dict[str, torch.Tensor]:
    """The classifier's weights, made by `recipe` from the compressor's scorer."""
    rng = random.Random(recipe.seed)
    torch.manual_seed(recipe.seed)
    texts = training_texts(recipe, recipe.window * 4, rng)  # 3.3-4.4 characters a token
    model = KeepClassifier(compressor.net, recipe.layers, recipe.window).float()
    steps_per_epoch = -(-len(texts) // recipe.batch)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=Console(file=sys.stderr), disable=not progress, transient=True) as bar:
        task = bar.add_task("prompt classifier: labelling windows", total=len(texts))
        data = labels(compressor, texts, recipe.rates, lambda: bar.advance(task))
        bar.update(task, description="prompt classifier: training", completed=0,
                   total=recipe.epochs * steps_per_epoch)
        rows = [(ids[:recipe.window], y[:recipe.window]) for ids, y in data]
        opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, recipe.lr, total_steps=recipe.epochs * steps_per_epoch,
                                                    pct_start=0.1)
        with torch.enable_grad():
            for _ in range(recipe.epochs):
                rng.shuffle(rows)
                for i in range(0, len(rows), recipe.batch):
                    batch = rows[i:i + recipe.batch]  # windows differ in length: one forward each
                    loss = sum(_loss(model, ids, y) for ids, y in batch) / len(batch)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    sched.step()
                    bar.advance(task)
    return {k: v.detach().to(torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous()
            for k, v in model.state_dict().items()}


def _loss(model: KeepClassifier, ids: list[int], target: torch.Tensor) -> torch.Tensor:
    logits = model(torch.tensor([ids], device=model.head.weight.device))[0]
    return nn.functional.binary_cross_entropy_with_logits(logits.float(), target.to(logits.device))
