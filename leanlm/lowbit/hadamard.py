"""Orthogonal rotations that spread outlier channels: Hadamard matrices (Sylvester's doubling of 1 or a Paley
order) with random signs, or a random orthogonal matrix where no Hadamard matrix of the order is known here. Used
by the offline rotation step (compress.quant.rotate), its online rotation of down_proj's input (OnlineRotation,
in the MLP) and the int4 KV cache (cache.int4)."""

from __future__ import annotations

import torch
from torch import nn

from leanlm import kernels


def _paley(q: int) -> torch.Tensor:
    """A Hadamard matrix of order q + 1 for a prime q = 3 (mod 4) (Paley's first construction)  # [q+1, q+1]"""
    squares = {(i * i) % q for i in range(1, q)}
    idx = torch.arange(q)
    diff = (idx[None, :] - idx[:, None]) % q
    chi = torch.zeros(q, q, dtype=torch.float64)
    chi[diff > 0] = -1.0
    chi[torch.isin(diff, torch.tensor(sorted(squares)))] = 1.0
    S = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    S[0, 1:], S[1:, 0], S[1:, 1:] = 1.0, -1.0, chi
    return S + torch.eye(q + 1, dtype=torch.float64)


def _prime(n: int) -> bool:
    return n > 1 and all(n % p for p in range(2, int(n ** 0.5) + 1))


def _base(n: int) -> tuple[torch.Tensor, int] | None:
    """(B, p): a Hadamard matrix B of order m (1 or a Paley order) and the power of two p with n = m p, or None"""
    for m in range(1, n + 1):
        if n % m or (n // m) & (n // m - 1):  # n / m must be a power of two
            continue
        if m == 1:
            return torch.ones(1, 1, dtype=torch.float64), n
        if m % 4 == 0 and _prime(m - 1) and (m - 1) % 4 == 3:
            return _paley(m - 1), n // m
    return None


def _sylvester(p: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix of order p, a power of two  # [p, p] float64"""
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < p:
        H = torch.kron(H, torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64))
    return H


def hadamard(n: int) -> torch.Tensor | None:
    """A Hadamard matrix of order n (entries +-1, H H^T = n I) when n = m 2^k with m = 1 or a Paley order, else
    None: B kron H_p (Sylvester's)  # [n, n] float64"""
    base = _base(n)
    return None if base is None else torch.kron(base[0], _sylvester(base[1]))


def _signs(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, (n,), generator=g).double() * 2 - 1


def rotation(n: int, seed: int = 0) -> torch.Tensor:
    """The orthogonal Q of order n: a Hadamard matrix with random column signs over sqrt(n), or a random orthogonal
    matrix where no Hadamard matrix of order n is known here  # [n, n] float64"""
    g = torch.Generator().manual_seed(seed)
    H = hadamard(n)
    if H is None:
        Q, R = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
        return Q * torch.sign(torch.diagonal(R))  # a uniformly random orthogonal matrix
    return H * _signs(n, g) / n ** 0.5


_FACTORS: dict[tuple, tuple] = {}  # (n, seed, device) -> OnlineRotation's matrices, shared by its layers


def _online_factors(n: int, seed: int, device: torch.device) -> tuple:
    """OnlineRotation's (left, right, scale) on `device`: (B^T, H_p, signs / sqrt(n)), or (the dense rotation, None,
    None) where no Hadamard matrix of order n is known here. Made once (a plain dict: torch.compile traces a lookup
    in it, where it cannot make them, with a seeded generator, nor trace through lru_cache). Never inference
    tensors, even when first made under inference_mode: a model scored, then trained (a distill step), uses them."""
    key = (n, seed, device)
    if key not in _FACTORS:
        with torch.inference_mode(False):
            _FACTORS[key] = _made_factors(n, seed, device)
    return _FACTORS[key]


def _made_factors(n: int, seed: int, device: torch.device) -> tuple:
    base = _base(n)
    if base is None:
        made = rotation(n, seed), None, None
    else:
        made = base[0].T, _sylvester(base[1]), _signs(n, torch.Generator().manual_seed(seed)) / n ** 0.5
    return tuple(None if t is None else t.float().contiguous().to(device) for t in made)


class OnlineRotation(nn.Module):
    """x -> x @ rotation(n, seed) at run time (QuaRot's online Hadamard). Where rotation(n) is B kron H_p with
    random signs, x is viewed as [..., m, p] and multiplied by B^T on the left and H_p on the right: n (m + p)
    multiply-adds a row where the dense product takes n^2 (1536 = 12 x 128: 215k against 2.4M). In float32; on the
    CPU (float32 or bf16 x, no gradient) by leanlm's kernel, H_p as a fast Walsh-Hadamard transform (p log p adds),
    else as two GEMMs. The matrices are made on first use on the input's device (a model is built on the meta
    device, then loaded), once for all the layers that share (n, seed), and never saved: the seed in the model's
    config makes them."""

    def __init__(self, n: int, seed: int):
        super().__init__()
        self.n, self.seed = n, seed

    def factors(self, device: torch.device) -> tuple:
        """(B^T, H_p, signs / sqrt(n)) on `device`, or (the dense rotation, None, None). A compiled step finds
        them made before it (generation.compiled.StepCompiler makes every rotation's)."""
        return _online_factors(self.n, self.seed, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        left, right, scale = self.factors(x.device)
        if right is None:
            return (x.float() @ left).to(x.dtype)
        grad = torch.is_grad_enabled() and x.requires_grad
        if x.is_cpu and x.dtype in (torch.float32, torch.bfloat16) and not grad and (ops := kernels.ops()) is not None:
            return ops.hadamard_rotate(x.reshape(-1, self.n), left, scale).view(x.shape)
        return self.gemms(x)

    def gemms(self, x: torch.Tensor) -> torch.Tensor:
        """The Kronecker product as two float32 GEMMs (off the CPU kernel's path: other devices, autograd)."""
        left, right, scale = self.factors(x.device)
        y = x.float().unflatten(-1, (left.shape[0], -1)) @ right  # [..., m, p]: one GEMM of all rows' m x p
        y = (y.transpose(-1, -2) @ left.T).transpose(-1, -2)  # B^T y, again as one GEMM
        return (y.flatten(-2) * scale).to(x.dtype)

    def extra_repr(self) -> str:
        return f"n={self.n}, seed={self.seed}"
