"""Calibration accumulators over a Linear layer's inputs: each takes `add_batch(x)` with x [..., K] and
exposes `.value`. Sums are kept in float64 so that many batches add up without drift."""

from __future__ import annotations

import torch

from leanlm.errors import LeanLMError


class _InputStats:
    """Shared bookkeeping: K input channels, rows seen, input checks."""

    def __init__(self, K: int):
        if not isinstance(K, int) or K < 1:
            raise LeanLMError(f"{type(self).__name__} needs a positive number of input channels, got K={K!r}")
        self.K = K
        self.rows = 0

    def _rows_of(self, x: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Flatten leading dims and upcast  # [..., K] -> [M, K] in `dtype`"""
        if not (x.is_floating_point() and x.dim() >= 1 and x.shape[-1] == self.K):
            raise LeanLMError(f"{type(self).__name__}(K={self.K}) got a {x.dtype} tensor shaped {tuple(x.shape)}; "
                              f"pass the layer's floating-point input shaped [..., {self.K}]")
        x = x.detach().reshape(-1, self.K).to(dtype)
        self.rows += x.shape[0]
        return x

    def check_seen(self) -> None:
        if self.rows == 0:
            raise LeanLMError(f"{type(self).__name__} has seen no rows; call add_batch() with calibration inputs first")


class Hessian(_InputStats):
    """GPTQ's layer Hessian 2 X^T X / rows over all rows seen (https://arxiv.org/abs/2210.17323)  # [K, K]"""

    def __init__(self, K: int, device: torch.device | str | None = None):
        super().__init__(K)
        self._xtx = torch.zeros(K, K, dtype=torch.float64, device=device)

    def add_batch(self, x: torch.Tensor) -> None:
        """Accumulate x [..., K]: one batch's X^T X in float32 (a float64 product runs ~10x slower on CPU and
        dominated calibration), added to the float64 sum over batches."""
        x = self._rows_of(x, torch.float32).to(self._xtx.device)
        self._xtx += x.T @ x

    @property
    def value(self) -> torch.Tensor:
        """2 X^T X / rows as float32  # [K, K]"""
        self.check_seen()
        return (self._xtx * (2.0 / self.rows)).float()


class ChannelNorm(_InputStats):
    """Per-input-channel L2 norm ||X_j||_2 over all rows, Wanda's activation term
    (https://arxiv.org/abs/2306.11695)  # [K]"""

    def __init__(self, K: int, device: torch.device | str | None = None):
        super().__init__(K)
        self._sumsq = torch.zeros(K, dtype=torch.float64, device=device)

    def add_batch(self, x: torch.Tensor) -> None:
        """Accumulate x [..., K]."""
        x = self._rows_of(x).to(self._sumsq.device)
        self._sumsq += x.square().sum(0)

    @property
    def value(self) -> torch.Tensor:
        """sqrt(sum_rows x_j^2) as float32  # [K]"""
        self.check_seen()
        return self._sumsq.sqrt().float()


class AbsMax(_InputStats):
    """Per-input-channel max |x| over all rows, as SmoothQuant (https://arxiv.org/abs/2211.10438), AWQ and
    LLM.int8() use it  # [K]"""

    def __init__(self, K: int, device: torch.device | str | None = None):
        super().__init__(K)
        self._amax = torch.zeros(K, dtype=torch.float64, device=device)

    def add_batch(self, x: torch.Tensor) -> None:
        """Accumulate x [..., K]."""
        x = self._rows_of(x).to(self._amax.device)
        if x.shape[0]:
            torch.maximum(self._amax, x.abs().amax(0), out=self._amax)

    @property
    def value(self) -> torch.Tensor:
        """max_rows |x_j| as float32  # [K]"""
        self.check_seen()
        return self._amax.float()
