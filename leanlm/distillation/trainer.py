"""The distillation trainer: a student learns a teacher's next-token distributions on windows of text.

Small enough for a 2-core CPU: float32 master weights with bf16 autocast for the products, AdamW with linear
warm-up then cosine decay, gradient accumulation, optional gradient checkpointing, a budget in steps, tokens or
minutes, evaluation (perplexity and KL to the teacher) at intervals, and checkpoints that resume bit for bit
(the windows of step s are drawn from a generator seeded by s, and so are the student's own samples; nothing else
is random). A pruned student keeps its zeros: the masks are re-applied after every optimizer step (sparse
fine-tuning). `prune_to` prunes while training instead (gradual magnitude pruning), and `on_policy` trains a share
of the windows on the student's own continuations (GKD's on-policy fraction).
"""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from safetensors.torch import load_file, save_file
from torch.utils.checkpoint import checkpoint

from leanlm.distillation import losses
from leanlm.distillation.features import captured, mixed_samples, uniform_layer_map
from leanlm.compress.registry import decoder_linears
from leanlm.compress.sparse.masks import check_sparsity, row_mask
from leanlm.errors import LeanLMError
from leanlm.eval.datasets import calibration_samples
from leanlm.eval.perplexity import score
from leanlm.generation.decode import generate_ids
from leanlm.generation.sampling import SamplingParams

# name -> loss(student logits, teacher logits, labels, config); labels are the next tokens of the text
LOSSES = {
    "fkl": lambda s, t, y, c: losses.forward_kl(s, t, c.temperature),
    "rkl": lambda s, t, y, c: losses.reverse_kl(s, t, c.temperature),
    "jsd": lambda s, t, y, c: losses.jsd(s, t, c.beta, c.temperature),
    "skl": lambda s, t, y, c: losses.skew_kl(s, t, c.alpha, False, c.temperature),
    "srkl": lambda s, t, y, c: losses.skew_kl(s, t, c.alpha, True, c.temperature),
    "topk": lambda s, t, y, c: losses.topk_kl(s, *t, c.temperature),  # t: the teacher's (values, indices)
    "slim": lambda s, t, y, c: losses.slim(s, *t, y, c.temperature),
    "hard": lambda s, t, y, c: losses.hard_label(s, t.argmax(-1)),  # the teacher's greedy labels
    "ce": lambda s, t, y, c: losses.hard_label(s, y),  # the text's own next tokens: plain fine-tuning
    "tinybert": None,  # forward KL + hidden states + attention maps: Trainer.tinybert_loss
    "minillm": None,  # sequence-level reverse KL on teacher-mixed samples: Trainer.minillm_loss
}
TOPK = {"topk", "slim"}  # the losses that read only the teacher's top-k logits: those can be cached on disk
CHUNK_LOGITS = 1 << 22  # logits a chunk of the loss holds at once (Trainer.chunks)


@dataclass(frozen=True)
class DistillConfig:
    loss: str = "fkl"
    temperature: float = 1.0
    beta: float = 0.5  # jsd
    alpha: float = 0.1  # skl, srkl
    top_k: int = 64  # topk, slim
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup: int = 10  # steps of linear warm-up
    batch_size: int = 4
    seq_len: int = 256
    grad_accum: int = 1
    steps: int | None = None  # the budget: steps, tokens or minutes (the first given; steps win)
    tokens: int | None = None
    minutes: float | None = None
    eval_every: int = 50
    eval_tokens: int = 4096
    checkpoint_every: int = 100
    gradient_checkpointing: bool = False
    autocast: bool = True  # bf16 products (float32 master weights and sums)
    seed: int = 0
    on_policy: float = 0.0  # GKD's lambda: the share of windows whose second half the student samples itself
    prune_to: float | None = None  # gradual magnitude pruning: each row's sparsity at the end of the schedule
    prune_end: float = 0.75  # the fraction of the run by which prune_to is reached (the rest recovers)
    prune_every: int = 10  # steps between two pruning rounds
    mix_alpha: float = 0.2  # minillm: the teacher's share of the sampling distribution
    layer_map: tuple[int, ...] | None = None  # tinybert: the teacher layer each student layer learns (None: uniform)

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise LeanLMError(f"unknown distillation loss {self.loss!r}; choose one of {', '.join(LOSSES)}")
        if self.temperature <= 0 or self.lr <= 0:
            raise LeanLMError(f"temperature and lr must be positive (got {self.temperature}, {self.lr})")
        if min(self.batch_size, self.seq_len, self.grad_accum) < 1 or self.seq_len < 2:
            raise LeanLMError("batch_size and grad_accum must be at least 1, seq_len at least 2")
        if self.steps is None and self.tokens is None and self.minutes is None:
            raise LeanLMError("give a budget: steps, tokens or minutes")
        if not 0.0 <= self.on_policy <= 1.0:
            raise LeanLMError(f"on_policy={self.on_policy} is a share of the windows: give a value in [0, 1]")
        if not 0.0 <= self.mix_alpha <= 1.0:
            raise LeanLMError(f"mix_alpha={self.mix_alpha} is the teacher's share: give a value in [0, 1]")
        if self.prune_to is not None:
            check_sparsity(self.prune_to)
            if not 0.0 < self.prune_end <= 1.0 or self.prune_every < 1:
                raise LeanLMError("prune_end must lie in (0, 1] and prune_every be at least 1")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len * self.grad_accum

    def total_steps(self) -> int | None:
        """The schedule's length; None for a budget in minutes alone (then it is estimated from the first steps)."""
        if self.steps is not None:
            return self.steps
        return None if self.tokens is None else max(1, math.ceil(self.tokens / self.tokens_per_step))


@dataclass
class History:
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)  # {"step", "ppl", "kl", "top1"}
    seconds: float = 0.0
    tokens: int = 0


def learning_rate(step: int, total: int, warmup: int, peak: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to 0 at `total` (step counts from 0)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def gradual_sparsity(step: int, total: int, final: float, end: float = 0.75) -> float:
    """Zhu & Gupta's cubic schedule (https://arxiv.org/abs/1710.01878) from 0 at step 0 to `final` at step
    end * total, held after: s = final * (1 - (1 - step / (end * total))^3), fast early while many weights are
    redundant, slow as the rest grow important."""
    progress = min(1.0, step / max(1.0, end * total))
    return final * (1.0 - (1.0 - progress) ** 3)


def sparsity_masks(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> bool mask of the exact zeros of each decoder projection that has any (a pruned model's)."""
    return {name: linear.weight == 0 for name, linear in decoder_linears(model) if (linear.weight == 0).any()}


@contextmanager
def checkpointed(model: torch.nn.Module):
    """Each decoder block recomputes its activations in the backward pass instead of keeping them."""
    originals = [block.forward for block in model.layers]
    for block, forward in zip(model.layers, originals):
        block.forward = functools.partial(checkpoint, forward, use_reentrant=False)
    try:
        yield
    finally:
        for block in model.layers:
            del block.forward  # the class's method again


class Trainer:
    """Distils `teacher` into `student` (same vocabulary) on windows of `train_ids` [N]; `eval_ids` [M] for the
    evaluations. The student trains in float32 (it is converted in place); `out` holds checkpoints;
    `logit_cache` the teacher's top-k logits of each step (topk and slim losses), so that the teacher runs once
    for any number of students or runs on the same windows; `trains(name)` says which parameters learn (all of
    them by default); `after_step(trainer)` runs after each optimizer step (before `step` counts it)."""

    def __init__(self, teacher, student, train_ids: torch.Tensor, eval_ids: torch.Tensor | None,
                 config: DistillConfig, out: Path | None = None, logit_cache: Path | None = None,
                 trains=lambda name: True, after_step=None):
        if teacher.config.vocab_size != student.config.vocab_size:
            raise LeanLMError(f"teacher and student vocabularies differ ({teacher.config.vocab_size} vs "
                              f"{student.config.vocab_size} tokens): distillation needs the same tokenizer")
        if not isinstance(student.lm_head, torch.nn.Linear):
            raise LeanLMError("the student's lm_head is quantized, and distillation trains through a float head: "
                              "quantize the lm_head after distilling (a later recipe step)")
        if len(train_ids) <= config.seq_len:
            raise LeanLMError(f"the training text has {len(train_ids)} tokens; seq_len {config.seq_len} needs more")
        self.teacher, self.student, self.config, self.out = teacher.eval(), student, config, out
        self.train_ids, self.eval_ids = train_ids, eval_ids
        self.logit_cache = None if logit_cache is None else Path(logit_cache)
        student.float().train()
        for name, p in student.named_parameters():
            p.requires_grad_(trains(name))
        self.device = next(student.parameters()).device  # the teacher's too (CUDA when the models are there)
        self.masks = sparsity_masks(student)
        self.sparsity = 0.0  # what gradual pruning has reached
        self.params = [p for p in student.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, betas=(0.9, 0.95),
                                           weight_decay=config.weight_decay)
        self.history, self.step, self.total = History(), 0, config.total_steps()
        self.after_step = after_step
        if config.loss == "tinybert":
            self.layer_map = self._check_tinybert(config.layer_map)

    def _check_tinybert(self, layer_map) -> tuple[int, ...]:
        s, t = self.student.config, self.teacher.config
        layer_map = tuple(layer_map) if layer_map is not None else uniform_layer_map(s.num_layers, t.num_layers)
        if len(layer_map) != s.num_layers or not all(0 <= g < t.num_layers for g in layer_map):
            raise LeanLMError(f"layer_map {list(layer_map)}: give one teacher layer (0..{t.num_layers - 1}) for each "
                              f"of the student's {s.num_layers} layers")
        if (s.hidden_size, s.num_heads) != (t.hidden_size, t.num_heads):
            raise LeanLMError(f"tinybert matches states and attention maps: the student's width and heads "
                              f"({s.hidden_size}, {s.num_heads}) must be the teacher's ({t.hidden_size}, "
                              f"{t.num_heads}); use another loss for this student")
        return layer_map

    def seed(self, step: int, micro: int) -> int:
        """What every random choice of a micro-batch is drawn from (so a resumed run draws the same)."""
        return (self.config.seed * 1_000_003 + step) * 1009 + micro

    def batch(self, step: int, micro: int) -> torch.Tensor:
        """The windows of one micro-batch: drawn from a generator seeded by (seed, step, micro)  # [B, T + 1]"""
        seed = self.seed(step, micro)
        tokens = calibration_samples(self.train_ids, self.config.batch_size, self.config.seq_len + 1, seed)
        if self.config.on_policy and torch.rand(1, generator=torch.Generator().manual_seed(seed)).item() < \
                self.config.on_policy:
            tokens = self.student_continues(tokens, seed)
        return tokens

    def student_continues(self, tokens: torch.Tensor, seed: int) -> torch.Tensor:
        """The windows' first halves, each continued by the student's own samples (temperature 1)  # [B, T + 1]"""
        half = tokens.shape[1] // 2
        params = SamplingParams(temperature=1.0, max_tokens=tokens.shape[1] - half, seed=seed, ignore_eos=True)
        new = list(generate_ids(self.student, tokens[:, :half].tolist(), params))
        return torch.cat([tokens[:, :half], torch.tensor(new).T], dim=1)

    def teacher_targets(self, inputs: torch.Tensor, positions: torch.Tensor, key: str):
        """What the loss reads of the teacher on inputs [B, T]: its final states [B, T, H] (logit_loss makes the
        logits a chunk at a time), or for the top-k losses its (values, indices) [B, T, k], read from the logit
        cache when an earlier run (another student, a resumed run) stored them."""
        if self.config.loss not in TOPK:
            with torch.no_grad():
                return self.teacher.hidden(inputs, positions)
        file = None if self.logit_cache is None else self.logit_cache / f"{key}.safetensors"
        if file is not None and file.exists():
            stored = load_file(str(file), device=str(self.device))
            if torch.equal(stored["inputs"], inputs) and stored["values"].shape[-1] == self.config.top_k:
                return stored["values"].float(), stored["indices"].long()
        with torch.no_grad():
            states = self.teacher.hidden(inputs, positions).flatten(0, 1)
            top = [self.teacher.logits(states[rows]).float().topk(self.config.top_k, dim=-1)
                   for rows in self.chunks(len(states))]
            values, indices = (torch.cat(part).unflatten(0, inputs.shape) for part in zip(*top))
        if file is not None:
            file.parent.mkdir(parents=True, exist_ok=True)
            save_file({"inputs": inputs.contiguous(), "values": values.to(torch.bfloat16).contiguous(),
                       "indices": indices.to(torch.int32).contiguous()}, str(file))
            values = values.to(torch.bfloat16).float()  # what a later run reads back: every run trains alike
        return values, indices

    def chunks(self, rows: int) -> list[slice]:
        """Row ranges of about 4M logits each (16 MB in float32): small enough to stay in the allocator's heap and
        the caches, where a whole [B, T, V] tensor (200 MB at 1024 tokens of a 49k vocabulary) is mapped afresh,
        page by page, by every pass over it."""
        step = max(1, CHUNK_LOGITS // self.student.config.vocab_size)
        return [slice(start, start + step) for start in range(0, rows, step)]

    def loss(self, tokens: torch.Tensor, key: str = "", seed: int = 0) -> torch.Tensor:
        """The configured loss on one micro-batch; `key` names its teacher logits in the cache, `seed` draws its
        samples (minillm)  # tokens [B, T + 1]"""
        tokens = tokens.to(self.device)
        if self.config.loss == "minillm":
            return self.minillm_loss(tokens, seed)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(inputs.shape[1], device=self.device)[None].expand_as(inputs)
        if self.config.loss == "tinybert":
            return self.tinybert_loss(inputs, positions)
        teacher = self.teacher_targets(inputs, positions, key)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.config.autocast):
            states = self.student.hidden(inputs, positions)
        return self.logit_loss(states, teacher, labels)

    def logit_loss(self, states: torch.Tensor, teacher, labels: torch.Tensor) -> torch.Tensor:
        """The configured per-position loss from the student's final states [B, T, H] (before the final norm), its
        mean over the positions taken a chunk of rows at a time by ChunkedHead, so that no [B, T, V] tensor exists."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.config.autocast):
            x = self.student.norm(states).flatten(0, 1)
        weight = self.student.lm_head.weight
        if self.config.autocast:
            x, weight = x.to(torch.bfloat16), weight.to(torch.bfloat16)  # once, not once a chunk
        labels = labels.flatten()
        teacher = teacher.flatten(0, 1) if torch.is_tensor(teacher) else [t.flatten(0, 1) for t in teacher]

        def chunk_loss(logits: torch.Tensor, rows: slice) -> torch.Tensor:
            if torch.is_tensor(teacher):
                with torch.no_grad():
                    part = self.teacher.logits(teacher[rows]).float()
            else:
                part = [t[rows] for t in teacher]
            return LOSSES[self.config.loss](logits.float(), part, labels[rows], self.config)

        return ChunkedHead.apply(x, weight, chunk_loss, self.chunks(len(x)))

    def tinybert_loss(self, inputs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """TinyBERT (arXiv 1909.10351) in one stage: forward KL on the logits, plus the MSE of the embeddings and of
        each student layer's output against its teacher layer's (both divided by the teacher state's RMS, so that
        the deep layers' large residual streams do not drown the rest), plus the MSE of their attention score maps."""
        with captured(self.teacher, sorted(set(self.layer_map))) as t, torch.no_grad():
            teacher = self.teacher(inputs, positions).float()
        with captured(self.student, list(range(len(self.layer_map)))) as s, \
                torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.config.autocast):
            student = self.student(inputs, positions)

        def states(mine, theirs):
            rms = theirs.float().pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6)
            return losses.hidden_mse(mine.float() / rms, theirs.float() / rms)

        pairs = list(enumerate(self.layer_map))
        hidden = (states(s.embedding, t.embedding) + sum(states(s.hidden[m], t.hidden[g]) for m, g in pairs)) / \
            (len(pairs) + 1)
        attention = sum(losses.attention_mse(s.scores[m], t.scores[g]) for m, g in pairs) / len(pairs)
        return losses.forward_kl(student.float(), teacher, self.config.temperature) + hidden + attention

    def minillm_loss(self, tokens: torch.Tensor, seed: int) -> torch.Tensor:
        """MiniLLM (arXiv 2306.08543): the windows' first halves as prompts, continued by teacher-mixed sampling;
        the sequence-level reverse KL's policy gradient on those continuations (length-normalized rewards,
        importance weights for the mixing)."""
        half = tokens.shape[1] // 2
        sampled, logp = mixed_samples(self.student, self.teacher, tokens[:, :half], tokens.shape[1] - half,
                                      self.config.mix_alpha, torch.Generator().manual_seed(seed))
        inputs = torch.cat([tokens[:, :half], sampled], 1)[:, :-1]
        positions = torch.arange(inputs.shape[1], device=self.device)[None].expand_as(inputs)
        with torch.no_grad():
            teacher = self.teacher(inputs, positions).float()[:, half - 1 :]  # the rows predicting the samples
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.config.autocast):
            student = self.student(inputs, positions)
        return losses.minillm(student.float()[:, half - 1 :], teacher, sampled, sample_logp=logp)

    def train_step(self) -> float:
        """One optimizer step (grad_accum micro-batches); returns the mean loss."""
        c = self.config
        lr = learning_rate(self.step, self.total or c.warmup + 1, c.warmup, c.lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(c.grad_accum):
            loss = self.loss(self.batch(self.step, micro), f"{self.step}-{micro}", self.seed(self.step, micro))
            loss = loss / c.grad_accum
            loss.backward()
            total += loss.item()
        self.optimizer.step()
        if self.after_step is not None:
            self.after_step(self)
        if c.prune_to is not None:
            steps = self.total or c.warmup + 1
            if self.step % c.prune_every == 0 or self.step + 1 >= c.prune_end * steps:  # the last rounds hit it
                self.prune(gradual_sparsity(self.step + 1, steps, c.prune_to, c.prune_end))
        with torch.no_grad():
            for name, mask in self.masks.items():
                self.student.get_submodule(name).weight.masked_fill_(mask, 0)
        self.history.steps.append(self.step)
        self.history.loss.append(total)
        self.history.lr.append(lr)
        self.history.tokens += c.tokens_per_step
        self.step += 1
        return total

    def prune(self, sparsity: float) -> None:
        """Every decoder projection's rows down to `sparsity` by magnitude (the zeros of earlier rounds are the
        lowest |w| and stay pruned); the masks then hold through the optimizer steps until the next round."""
        if sparsity <= self.sparsity:
            return
        with torch.no_grad():
            for name, linear in decoder_linears(self.student):
                mask = row_mask(linear.weight.abs(), sparsity)
                self.masks[name] = mask | self.masks[name] if name in self.masks else mask  # a pruned student's too
        self.sparsity = sparsity

    def evaluate(self) -> dict:
        """Perplexity of the student and its KL to the teacher on the first eval_tokens of eval_ids."""
        self.student.eval()
        ids = self.eval_ids[: self.config.eval_tokens]
        ppl, agree = score(self.student, ids, self.teacher, window=self.config.seq_len)
        self.student.train()
        result = {"step": self.step, "ppl": ppl.perplexity, "kl": agree.kl, "top1": agree.top1}
        self.history.evals.append(result)
        return result

    def done(self) -> bool:
        c = self.config
        if self.total is not None and self.step >= self.total:
            return True
        return c.minutes is not None and self.history.seconds >= 60 * c.minutes

    def run(self, progress: bool = True) -> History:
        """Train until the budget is spent, evaluating and checkpointing at the configured intervals."""
        c = self.config
        bar = Progress(TextColumn("distilling"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                       TimeRemainingColumn(), console=Console(file=sys.stderr), disable=not progress)
        context = checkpointed(self.student) if c.gradient_checkpointing else _nothing()
        if self.eval_ids is not None and not self.history.evals:
            self.evaluate()
        with bar, context:
            task = bar.add_task("", total=self.total, completed=self.step, info="")
            while not self.done():
                start = time.perf_counter()
                loss = self.train_step()
                self.history.seconds += time.perf_counter() - start
                if self.total is None and self.step == 3:  # a budget in minutes: size the schedule now
                    self.total = max(self.step + 1, int(60 * c.minutes / (self.history.seconds / self.step)))
                    bar.update(task, total=self.total)
                info = f"loss {loss:.4f}"
                if self.eval_ids is not None and (self.step % c.eval_every == 0 or self.done()):
                    e = self.evaluate()
                    info += f"  ppl {e['ppl']:.2f}  kl {e['kl']:.4f}"
                bar.update(task, completed=self.step, info=info)
                if self.out is not None and (self.step % c.checkpoint_every == 0 or self.done()):
                    self.save_checkpoint(self.out)
        return self.history

    def save_checkpoint(self, out: Path) -> None:
        """The student's weights, the optimizer's moments and the trainer's state under out/checkpoint/."""
        path = Path(out) / "checkpoint"
        path.mkdir(parents=True, exist_ok=True)
        weights = {k: v.contiguous() for k, v in self.student.state_dict().items() if not k.startswith("rope_")}
        if self.student.lm_head_is_embedding:
            weights.pop("lm_head.weight")  # tied: the embedding's own storage
        save_file(weights, str(path / "student.safetensors"))
        moments = {}
        for i, p in enumerate(self.params):
            for key, value in self.optimizer.state.get(p, {}).items():
                moments[f"{i}.{key}"] = value.reshape(1) if value.dim() == 0 else value
        save_file(moments, str(path / "optimizer.safetensors"))
        state = {"step": self.step, "total": self.total, "config": asdict(self.config),
                 "history": asdict(self.history), "sparsity": self.sparsity}
        (path / "trainer.json").write_text(json.dumps(state))

    def load_checkpoint(self, out: Path) -> None:
        """Continue from out/checkpoint/: the same config (budget aside) is required."""
        path = Path(out) / "checkpoint"
        if not (path / "trainer.json").exists():
            raise LeanLMError(f"{out} holds no checkpoint to resume (checkpoint/trainer.json)")
        state = json.loads((path / "trainer.json").read_text())
        budget = ("steps", "tokens", "minutes")
        saved = {k: v for k, v in state["config"].items() if k not in budget}
        mine = {k: v for k, v in json.loads(json.dumps(asdict(self.config))).items() if k not in budget}  # as saved
        if saved != mine:
            changed = sorted(k for k in mine if saved.get(k) != mine[k])
            raise LeanLMError(f"the checkpoint in {out} was made with other settings ({', '.join(changed)}); "
                              "resume with the same ones")
        weights = load_file(str(path / "student.safetensors"))
        self.student.load_state_dict(weights, strict=False)
        moments = load_file(str(path / "optimizer.safetensors"))
        for i, p in enumerate(self.params):
            entry = {key.split(".", 1)[1]: v if key.endswith(".step") else v.to(p.device)
                     for key, v in moments.items() if key.split(".", 1)[0] == str(i)}
            if entry:
                entry["step"] = entry["step"].reshape(())
                self.optimizer.state[p] = entry
        self.step, self.history = state["step"], History(**state["history"])
        self.total = self.config.total_steps() or state["total"]
        self.masks, self.sparsity = sparsity_masks(self.student), state.get("sparsity", 0.0)


class ChunkedHead(torch.autograd.Function):
    """mean over rows of loss(x W^T), a chunk of rows at a time, each chunk's gradient taken in the forward pass (as
    Liger-Kernel's fused linear cross-entropy does): a chunk's logits live only while it is scored, and nothing is
    recomputed in the backward pass, which only scales the stored gradients of x [N, H] and W [V, H].
    loss(logits [R, V], rows) is the mean over the chunk's R rows."""

    @staticmethod
    def forward(ctx, x, weight, loss, chunks):
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x = torch.zeros_like(x) if need_x else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None  # summed in float32
        total = torch.zeros((), device=x.device)
        for rows in chunks:
            with torch.enable_grad():
                xs = x[rows].detach().requires_grad_(need_x)
                w = weight.detach().requires_grad_(need_w)
                value = loss(F.linear(xs, w), rows) * (len(xs) / len(x))
                wants = [t for t in (xs, w) if t.requires_grad]
                grads = iter(torch.autograd.grad(value, wants) if wants else ())
            if need_x:
                grad_x[rows] = next(grads)
            if need_w:
                grad_w += next(grads)
            total += value.detach()
        ctx.save_for_backward(grad_x, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad):
        grad_x, grad_w = ctx.saved_tensors
        return None if grad_x is None else grad_x * grad, None if grad_w is None else grad_w * grad, None, None


@contextmanager
def _nothing():
    yield


def plot_history(history: History, path: Path) -> None:
    """The loss per step and, where evaluated, the student's perplexity, as a PNG."""
    import matplotlib  # heavy: only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(history.steps, history.loss, color="tab:blue", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss", color="tab:blue")
    if history.evals:
        ax2 = ax.twinx()
        ax2.plot([e["step"] for e in history.evals], [e["ppl"] for e in history.evals], "o-", color="tab:red")
        ax2.set_ylabel("perplexity (evaluation)", color="tab:red")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
