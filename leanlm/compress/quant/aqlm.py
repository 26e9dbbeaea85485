"""AQLM: additive codebooks, 1-4 bits a weight (lowbit/codebook.py's format: `bits` codebooks of 256 codewords over
groups of 8 inputs, a scale per output row).

Each decoder block, on the inputs the already-quantized blocks give it:
1. every projection W [N, K] (rows divided by their RMS, the scale) is fitted layer by layer:
   - codebooks initialized by residual k-means over the 8-weight groups (the first on the groups, the next on what
     the first leaves), each dimension weighted by the input's Hessian diagonal;
   - codes chosen column group by column group in GPTQ's order (compress/obs.py), each group's rounding error fed
     into the groups not yet reached through the inverse Hessian; the codes of a group picked greedily codebook by
     codebook against the residual, then each re-picked once with the others fixed, under GPTQ's error weights;
   - codebooks and scales fitted by Adam to the layer objective tr((W - W~) H (W - W~)^T) with the codes fixed;
     codes and codebooks alternate for `rounds`;
2. the block's codebooks and scales are then tuned together by Adam so that its output fits the float model's
   output of that block (`iters` steps on mini-batches of the calibration windows; the codes stay).

https://arxiv.org/abs/2401.06118 (Egiazarian et al., AQLM: additive codebooks, codes by beam search on the layer
objective, codebooks by Adam, block fine-tuning); https://arxiv.org/abs/2402.15319 (van Baalen et al., GPTVQ: vector
codes in GPTQ's column order with the error fed forward, Hessian-weighted k-means initialization). leanlm searches
codes greedily (no beam) and feeds errors forward as GPTVQ does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from leanlm import kernels
from leanlm.compress.calibrate import DEFAULT_BATCH_SIZE, fit_block, input_stats, reconstruct
from leanlm.compress.obs import Pending, check_solver_args, inverse_cholesky, obs_update, solver_inputs
from leanlm.compress.registry import check_patterns, decoder_linears, last_match, layer_patterns, register
from leanlm.compress.stats import Hessian
from leanlm.errors import LeanLMError
from leanlm.lowbit.codebook import DIM, ENTRIES, AdditiveLinear, codebook_weight
from leanlm.lowbit.record import replace

_CHUNK = 1 << 16  # vectors per distance matrix [chunk, 256]
KMEANS_SAMPLE = 1 << 15  # groups k-means fits a codebook on (256 clusters of ~128 each): all of them took ~5 s a layer


def nearest(targets: torch.Tensor, weights: torch.Tensor, book: torch.Tensor) -> torch.Tensor:
    """Index of the codeword nearest each target under per-dimension weights: argmin_e sum_d w_d (t_d - book_ed)^2
    targets [V, 8], weights [V, 8] or [8], book [256, 8] -> [V] int64"""
    weights = weights.expand_as(targets)
    out = torch.empty(targets.shape[0], dtype=torch.int64, device=targets.device)
    for i in range(0, targets.shape[0], _CHUNK):
        t, w = targets[i:i + _CHUNK], weights[i:i + _CHUNK]
        # sum_d w (b^2 - 2 t b): the t^2 term is the same for every codeword
        out[i:i + _CHUNK] = (w @ (book * book).T - 2 * (w * t) @ book.T).argmin(-1)
    return out


def kmeans(vectors: torch.Tensor, weights: torch.Tensor, iters: int, generator: torch.Generator,
           sample: int = KMEANS_SAMPLE) -> torch.Tensor:
    """256 codewords fitted to vectors [V, 8] by weighted Lloyd steps on `sample` of them (weights [V, 8]: each
    dimension's centroid is the weighted mean of its cluster's values); codewords start at random vectors
    # -> [256, 8]"""
    pick = torch.randperm(vectors.shape[0], generator=generator)[:sample]
    vectors, weights = vectors[pick], weights[pick]
    book = vectors[:ENTRIES].clone()
    if book.shape[0] < ENTRIES:  # fewer vectors than codewords: the rest repeat them
        book = book.repeat(ENTRIES // book.shape[0] + 1, 1)[:ENTRIES]
    for _ in range(iters):
        idx = nearest(vectors, weights, book)[:, None].expand(-1, DIM)
        num = torch.zeros_like(book).scatter_add_(0, idx, weights * vectors)
        den = torch.zeros_like(book).scatter_add_(0, idx, weights)
        book = torch.where(den > 0, num / den.clamp_min(1e-30), book)  # an empty cluster keeps its codeword
    return book


def assign(targets: torch.Tensor, weights: torch.Tensor, books: torch.Tensor, codes: torch.Tensor | None = None
           ) -> torch.Tensor:
    """Codes for targets [V, 8] under per-dimension weights: without `codes`, codebook by codebook on what the
    earlier ones leave; then each codebook's code re-picked once with the others fixed  # books [C, 256, 8] ->
    [V, C] int64"""
    C, given = books.shape[0], codes is not None
    if not given:
        codes = torch.empty(targets.shape[0], C, dtype=torch.int64, device=targets.device)
        rest = targets.clone()
        for c in range(C):
            codes[:, c] = nearest(rest, weights, books[c])
            rest -= books[c][codes[:, c]]
    if C > 1 or given:  # one greedy codebook is already the nearest
        total = sum(books[c][codes[:, c]] for c in range(C))
        for c in range(C):
            total -= books[c][codes[:, c]]
            codes[:, c] = nearest(targets - total, weights, books[c])
            total += books[c][codes[:, c]]
    return codes


def _weight(codes: torch.Tensor, books: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codebook_weight of codebooks as this module holds them, [C, 256, 8] (lowbit stores them transposed)"""
    return codebook_weight(codes, books.transpose(1, 2), scales)


class _KernelWeight(torch.autograd.Function):
    """_weight in `dtype` (float32 or bf16) by kernels/codebook.cpp, its backward one pass over the weight's gradient
    (torch's gathers and scatter-add took 2.2 s of a 7.6 s distillation step: README)  # codes uint8 [K/8, C, N]"""

    @staticmethod
    def forward(ctx, codes: torch.Tensor, books: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
        ctx.save_for_backward(codes, books, scales)
        return kernels.ops().codebook_weight(codes, books, scales, dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        codes, books, scales = ctx.saved_tensors
        d_books, d_scales = kernels.ops().codebook_weight_backward(codes, books, scales, grad.contiguous())
        return None, d_books, d_scales, None


def init_codebooks(Wn: torch.Tensor, h: torch.Tensor, C: int, iters: int, generator: torch.Generator) -> torch.Tensor:
    """Residual k-means over the 8-weight groups of Wn [N, K], dimension d of group g weighted by h[8g + d] (the
    Hessian's diagonal)  # -> [C, 256, 8]"""
    vectors = Wn.reshape(-1, DIM)  # [N * K/8, 8]
    weights = h.reshape(1, -1, DIM).expand(Wn.shape[0], -1, -1).reshape(-1, DIM)
    books, rest = [], vectors.clone()
    for _ in range(C):
        book = kmeans(rest, weights, iters, generator)
        rest -= book[nearest(rest, weights, book)]
        books.append(book)
    return torch.stack(books)


def assign_in_order(Wn: torch.Tensor, U: torch.Tensor, books: torch.Tensor, block_size: int = 128) -> torch.Tensor:
    """Codes for Wn [N, K] group by group from the left, each group's error spread onto the later columns through
    U (inverse_cholesky's factor of H^-1), its codes picked under GPTQ's error weights 1 / U_jj^2  # -> [K/8, C, N]
    as lowbit.codebook stores them"""
    N, K = Wn.shape
    codes = torch.empty(N, K // DIM, books.shape[0], dtype=torch.int64, device=Wn.device)
    chosen = {}

    def column(j: int, w: torch.Tensor, pending: Pending) -> torch.Tensor:
        g = j // DIM
        if j % DIM == 0:
            weights = U.diagonal()[j:j + DIM] ** -2
            codes[:, g] = assign(pending(range(j, j + DIM)), weights, books)
            chosen["group"] = sum(books[c][codes[:, g, c]] for c in range(books.shape[0]))  # [N, 8]
        return chosen["group"][:, j % DIM:j % DIM + 1]

    obs_update(Wn.clone(), U, block_size, column)
    return codes.permute(1, 2, 0).contiguous()


def fit_codebooks(W: torch.Tensor, H: torch.Tensor, codes: torch.Tensor, books: torch.Tensor, scales: torch.Tensor,
                  steps: int, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Codebooks and scales by Adam on tr((W - W~) H (W - W~)^T) / tr(W H W^T) with the codes fixed; returns the
    best seen  # W [N, K], H [K, K], codes [K/8, C, N], books [C, 256, 8], scales [N]"""
    books, scales = books.clone().requires_grad_(), scales.clone().requires_grad_()
    opt = torch.optim.Adam([books, scales], lr=lr)
    norm = ((W @ H) * W).sum()
    best, best_loss = (books.detach().clone(), scales.detach().clone()), float("inf")
    with torch.enable_grad():
        for _ in range(steps + 1):
            diff = W - _weight(codes, books, scales)
            loss = ((diff @ H) * diff).sum() / norm
            if loss.item() < best_loss:
                best_loss, best = loss.item(), (books.detach().clone(), scales.detach().clone())
            opt.zero_grad()
            loss.backward()
            opt.step()
    return best


def aqlm_quantize(W: torch.Tensor, H: torch.Tensor, codebooks: int = 2, rounds: int = 2, kmeans_iters: int = 10,
                  fit_steps: int = 50, lr: float = 1e-3, damp: float = 0.01, seed: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] as additive codebooks on the layer Hessian H [K, K] (2 X^T X / rows): (codes [K/8, C, N] int64,
    codebooks [C, 256, 8], scales [N]) float32, the weight being lowbit.codebook.codebook_weight of them."""
    check_solver_args("aqlm_quantize", W, H, 128, damp)
    if W.shape[1] % DIM:
        raise LeanLMError(f"additive codebooks need in_features divisible by {DIM}, got {W.shape[1]}")
    W, H = solver_inputs(W, H)
    generator = torch.Generator().manual_seed(seed)
    scales = W.pow(2).mean(1).sqrt().clamp_min(1e-12)
    Wn = W / scales[:, None]
    books = init_codebooks(Wn, H.diagonal().float().clamp_min(1e-12), codebooks, kmeans_iters, generator)
    U = inverse_cholesky(H, damp)
    Hf = H.float()
    for _ in range(rounds):
        codes = assign_in_order(Wn, U, books)
        books, s = fit_codebooks(W, Hf, codes, books, scales, fit_steps, lr)
        books = books * (s / scales).mean()  # the scales' common drift moved into the codebooks
        scales = s / (s / scales).mean()
        Wn = W / scales[:, None]
    return codes, books, scales


class TunedCodebook(nn.Module):
    """A projection as additive codebooks whose codebooks and scales are parameters, standing in for the Linear
    while its block is tuned (the codes fixed) or while the model is distilled (the codes may change: update_codes)."""

    def __init__(self, bias: torch.Tensor | None, codes: torch.Tensor, books: torch.Tensor, scales: torch.Tensor):
        """codes [K/8, C, N], books [C, 256, 8], scales [N]"""
        super().__init__()
        self.bias = None if bias is None else bias.detach()
        self.codes = codes.to(torch.uint8)
        self.books = nn.Parameter(books.float().contiguous())
        self.scales = nn.Parameter(scales.float())
        self.grad: torch.Tensor | None = None  # d loss / d weight summed since the last update_codes (when tracked)
        self.h: torch.Tensor | None = None  # and sum of x^2 of each input, the diagonal of the layer's Hessian

    @classmethod
    def of(cls, packed: AdditiveLinear) -> "TunedCodebook":
        """A stored layer made trainable again (AQLM's end-to-end fine-tuning: distillation/step.py)."""
        return cls(packed.bias, packed.codes, packed.codebooks.transpose(1, 2), packed.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.get_autocast_dtype("cpu") if x.is_cpu and torch.is_autocast_enabled("cpu") else x.dtype
        if x.is_cpu and dtype in (torch.float32, torch.bfloat16) and kernels.ops() is not None:
            w = _KernelWeight.apply(self.codes, self.books, self.scales, dtype)
        else:
            w = _weight(self.codes, self.books, self.scales).to(dtype)
        if self.grad is not None and w.requires_grad:
            w.register_hook(self._gather)
            self.h += x.detach().float().pow(2).reshape(-1, x.shape[-1]).sum(0)
        return F.linear(x, w, self.bias)

    def _gather(self, grad: torch.Tensor) -> None:
        self.grad += grad

    def track_gradient(self) -> None:
        """Sum the loss's gradient with respect to the weight and the inputs' squares from now on, for update_codes."""
        if self.grad is None:
            self.grad = torch.zeros(self.scales.shape[0], self.codes.shape[0] * DIM, device=self.codes.device)
            self.h = torch.zeros(self.codes.shape[0] * DIM, device=self.codes.device)
        self.grad.zero_(), self.h.zero_()

    @torch.no_grad()
    def update_codes(self, step: float, fraction: float) -> int:
        """PV-tuning's linearized V step (Malinovskii et al., https://arxiv.org/abs/2405.14852) in the metric of the
        layer's diagonal Hessian h (the inputs' squares, as the codes were first chosen under): the codes of each
        8-weight group re-picked (each codebook's once, the others fixed) for the target w - a g / h (g: the
        gradient summed since the last call; a such that the move's RMS is `step` times the weight's), and kept in
        the `fraction` of the groups whose weights come nearest it. A kept change moves the weight by d with
        g.d < -d'hd / 2a: down the loss to first order. The sums stay (track_gradient starts them again). Returns
        the number of groups changed."""
        G, C, N = self.codes.shape
        books, scales = self.books.detach(), self.scales.detach()
        h = (self.h / self.h.mean()).clamp_min(1e-6)  # [K]
        w = _weight(self.codes, books, scales)  # [N, K]
        move = self.grad / h
        a = step * w.pow(2).mean().sqrt() / move.pow(2).mean().sqrt().clamp_min(1e-30)
        target = (w - a * move) / torch.where(scales == 0, 1.0, scales)[:, None]
        target = target.reshape(N, G, DIM).transpose(0, 1).reshape(G * N, DIM)  # groups in the codes' order
        weights = h.reshape(G, 1, DIM).expand(G, N, DIM).reshape(G * N, DIM)
        old = self.codes.long().permute(0, 2, 1).reshape(G * N, C)
        new = assign(target, weights, books, old.clone())

        def error(codes: torch.Tensor) -> torch.Tensor:  # each group's distance to the target, weight units
            approx = sum(books[c][codes[:, c]] for c in range(C))
            return (weights * (target - approx).pow(2)).sum(-1) * scales.repeat(G) ** 2

        gain = error(old) - error(new)
        top = gain.topk(max(1, int(fraction * G * N))).indices
        top = top[gain[top] > 0]
        old[top] = new[top]
        self.codes = old.reshape(G, N, C).permute(0, 2, 1).to(torch.uint8).contiguous()
        return top.numel()

    def pack(self) -> AdditiveLinear:
        return AdditiveLinear.from_codes(self.codes, self.books, self.scales, self.bias)


@dataclass(frozen=True)
class AQLM:
    """Additive codebooks onto lowbit.codebook's kernel. bits: codebooks of 8-bit codes per 8 weights (1-4, bits a
    weight before the codebooks and scales); iters: Adam steps of each block's codebooks and scales on its output
    (0: layer fits only); rounds: code assignments alternating with codebook fits per layer.

    layers (mixed precision, recipes only): {projection name or glob such as "layers.*.mlp.down_proj": codebooks}
    overrides bits per projection (1-4; the last matching pattern wins)."""

    name: ClassVar[str] = "aqlm"
    kind: ClassVar[str] = "quantize"
    needs_data: ClassVar[bool] = True
    bits: int = 2
    iters: int = 100
    lr: float = 1e-3
    rounds: int = 2
    fit_steps: int = 50
    kmeans_iters: int = 10
    batch_size: int = DEFAULT_BATCH_SIZE
    damp: float = 0.01
    seed: int = 0
    layers: dict | None = field(default=None, hash=False)  # a dict cannot be hashed; the other fields identify it

    def __post_init__(self):
        layers = layer_patterns("aqlm", self.layers, "codebooks")
        for where, bits in [("bits", self.bits), *((f"layers[{p!r}]", b) for p, b in layers.items())]:
            if isinstance(bits, bool) or bits not in (1, 2, 3, 4):
                raise LeanLMError(f"aqlm {where}={bits!r}: use 1 to 4 (codebooks of 8-bit codes per 8 weights)")
        for option, least in {"iters": 0, "rounds": 1, "fit_steps": 0, "kmeans_iters": 0, "batch_size": 1}.items():
            value = getattr(self, option)
            if not isinstance(value, int) or value < least:
                raise LeanLMError(f"aqlm {option}={value!r} must be a whole number >= {least}")
        if not self.lr > 0:
            raise LeanLMError(f"aqlm lr={self.lr!r} must be > 0")

    def codebooks(self, name: str) -> int:
        """Codebooks of the projection `name` (e.g. layers.3.mlp.down_proj): its last matching `layers` pattern's,
        else bits."""
        pattern = last_match(self.layers, name)
        return self.bits if pattern is None else self.layers[pattern]


def _tune(block: nn.Module, tuned: dict[str, TunedCodebook], inputs: torch.Tensor, targets: torch.Tensor, rope: tuple,
          config: AQLM, generator: torch.Generator) -> None:
    """Adam on the block's codebooks and scales so that block(inputs) fits targets (calibrate.fit_block); the best
    parameters seen stay."""
    params = [p for t in tuned.values() for p in t.parameters()]
    opt = torch.optim.Adam(params, lr=config.lr)

    def update(step: int, grads: tuple[torch.Tensor, ...]) -> None:
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()

    fit_block(block, params, inputs, targets, rope, config.iters, config.batch_size, generator, update)


@register(AQLM)
def aqlm(model, config: AQLM, progress=None, samples=None) -> dict[str, dict]:
    """Block by block (calibrate.reconstruct): each projection fitted on its Hessian over the block's
    quantized-model inputs, then the block's codebooks and scales tuned on its output, then packed."""
    generator = torch.Generator().manual_seed(config.seed)
    if config.layers:
        check_patterns("aqlm", config.layers, [name for name, _ in decoder_linears(model)])

    def step(i, block, linears, inputs, targets, rope, run):
        hessians = input_stats(linears, lambda linear: Hessian(linear.in_features), lambda: run(block, inputs))
        tuned = {}
        for name, linear in linears.items():
            codebooks = config.codebooks(f"layers.{i}.{name}")
            fitted = aqlm_quantize(linear.weight.detach().float(), hessians[name].value, codebooks, config.rounds,
                                   config.kmeans_iters, config.fit_steps, config.lr, config.damp, config.seed + i)
            tuned[name] = TunedCodebook(linear.bias, *fitted)
            replace(block, name, tuned[name])
        if config.iters:
            with torch.enable_grad():
                _tune(block, tuned, inputs, targets, rope, config, generator)
        return {name: t.pack() for name, t in tuned.items()}

    return reconstruct(model, samples, step, progress)
