"""Orthogonal rotations that spread outlier channels: Hadamard matrices (Sylvester's doubling of 1, 2 or a Paley
order) with random signs, or a random orthogonal matrix where no Hadamard matrix of the order is known here. Used
by the offline rotation step (compress.quant.rotate) and the int4 KV cache (cache.int4)."""

from __future__ import annotations

import torch


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


def hadamard(n: int) -> torch.Tensor | None:
    """A Hadamard matrix of order n (entries +-1, H H^T = n I) when n = m 2^k with m = 1, 2 or a Paley order, else
    None  # [n, n] float64"""
    for m in range(1, n + 1):
        if n % m or (n // m) & (n // m - 1):  # n / m must be a power of two
            continue
        if m in (1, 2):
            H = torch.ones(1, 1, dtype=torch.float64)
        elif m % 4 == 0 and _prime(m - 1) and (m - 1) % 4 == 3:
            H = _paley(m - 1)
        else:
            continue
        H2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        while H.shape[0] < n:
            H = torch.kron(H, H2)
        return H
    return None


def rotation(n: int, seed: int = 0) -> torch.Tensor:
    """The orthogonal Q of order n: a Hadamard matrix with random column signs over sqrt(n), or a random orthogonal
    matrix where no Hadamard matrix of order n is known here  # [n, n] float64"""
    g = torch.Generator().manual_seed(seed)
    H = hadamard(n)
    if H is None:
        Q, R = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
        return Q * torch.sign(torch.diagonal(R))  # a uniformly random orthogonal matrix
    signs = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
    return H * signs / n ** 0.5
