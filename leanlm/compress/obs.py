"""The OBS column solver GPTQ and SparseGPT share, as pure math: the columns of W [N, K] are replaced left to
right by values a method chooses (rounded onto a grid, pruned to 0, or both), and each column's error is spread
onto the columns not yet reached through the inverse layer Hessian, so the layer output X W^T moves as little as
the choices allow (Optimal Brain Surgeon's update, one column of every row at once).

Paper: https://arxiv.org/abs/2210.17323 (Frantar et al., GPTQ Algorithm 1: a fixed column order, the Cholesky
factor of H^-1 in place of H^-1 itself, lazy block updates); https://arxiv.org/abs/2301.00774 (Frantar &
Alistarh, SparseGPT Algorithm 1: the same loop with the mask chosen as it goes)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from leanlm.errors import LeanLMError
from leanlm.lowbit.primitives import QuantSpec, compute_qparams, dequantize, quantize

# pending(cols): columns >= the current one (a range, or a LongTensor of indices), as the errors so far left them
Pending = Callable[[range | torch.Tensor], torch.Tensor]
# column(j, w, pending): the new value of column j [N, 1], given its updated weights w [N, 1] (read-only)
Column = Callable[[int, torch.Tensor, Pending], torch.Tensor]


def check_solver_args(method: str, W: torch.Tensor, H: torch.Tensor, block_size: int, damp: float) -> None:
    """The checks every OBS solver makes of its arguments, in one clear message each."""
    if W.dim() != 2 or H.shape != (W.shape[1], W.shape[1]):
        raise LeanLMError(f"{method} needs W [N, K] and H [K, K]; got W {tuple(W.shape)}, H {tuple(H.shape)}")
    if not isinstance(block_size, int) or block_size < 1:
        raise LeanLMError(f"block_size={block_size!r} is invalid; use a positive integer such as 128")
    if damp < 0:
        raise LeanLMError(f"damp={damp!r} is negative; use a small non-negative ratio such as 0.01")


def solver_inputs(W: torch.Tensor, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies an OBS solver may edit: W float32 [N, K], H float64 [K, K]. An input that was always zero carries no
    information: its weights are dropped and H made invertible there."""
    W = W.detach().float().clone()
    H = H.detach().to(device=W.device, dtype=torch.float64).clone()
    dead = H.diagonal() == 0
    H.diagonal()[dead] = 1.0
    W[:, dead] = 0.0
    return W, H


def inverse_cholesky(H: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1 = U^T U, computed in float64  # [K, K] -> [K, K]
    float32. Row q of U is what removing column q does to the later columns; the damping keeps a Hessian from
    few (or collinear) calibration rows invertible."""
    H = H.clone()
    H.diagonal().add_(damp * H.diagonal().mean())
    L, info = torch.linalg.cholesky_ex(H)
    if info.item() == 0:
        U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
    if info.item() != 0 or not torch.isfinite(U).all():
        raise LeanLMError(f"the calibration Hessian is not positive definite even after dampening (damp={damp}); "
                          "use a larger damp (e.g. 0.05 or 0.1) or more calibration data")
    return U.float()


def obs_update(W: torch.Tensor, U: torch.Tensor, block_size: int, column: Column) -> torch.Tensor:
    """Replace column j of W by q = column(j, w, pending), j = 0 .. K-1, and spread its error err = (w - q) / U[j, j]
    onto the later columns (W[:, j:] -= err U[j, j:])  # W [N, K] (edited in place and returned), U [K, K]

    U is `inverse_cholesky`'s factor of H^-1, in W's column order. The updates are lazy (GPTQ's block trick): inside
    a block of block_size columns they are applied column by column, and the block's errors reach the columns
    after it in one product when the block ends, which gives the same W up to float summation order. So a method
    that looks ahead (a mask over several columns, a group's grid) reads columns through `pending`, never W."""
    K = W.shape[1]
    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        W1 = W[:, i1:i2].clone()  # the block, kept up to date column by column
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]

        def pending(cols: range | torch.Tensor) -> torch.Tensor:  # i: the column being chosen when called
            if isinstance(cols, range):
                if cols.stop <= i2:
                    return W1[:, cols.start - i1:cols.stop - i1].clone()
                cols = torch.arange(cols.start, cols.stop, device=W.device)
            cur = W[:, cols].clone()
            inside = cols < i2
            cur[:, inside] = W1[:, cols[inside] - i1]
            # Columns after this block have not had this block's lazy update yet: apply it here.
            cur[:, ~inside] -= Err1[:, :i] @ U[i1:i1 + i, cols[~inside]]
            return cur

        for i in range(i2 - i1):
            w = W1[:, i:i + 1]  # [N, 1]
            q = column(i1 + i, w, pending)
            err = (w - q) / U1[i, i]  # [N, 1]
            W1[:, i:] -= err * U1[i:i + 1, i:]
            Q1[:, i:i + 1] = q
            Err1[:, i:i + 1] = err
        W[:, i1:i2] = Q1
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]  # the block's errors reach the later columns in one product
    return W


class ColumnGrid:
    """A weight QuantSpec's grid, applied one column [N, 1] at a time as an OBS solver reaches it. A channel or
    tensor grid is fitted to the whole W up front; a group's grid is fitted (`fit`) when the solver first reaches
    one of its columns, on the group's weights as the errors so far have updated them. Columns are named by their
    index k in W as given (a solver that reorders columns maps them back).

    scale, zero: as `compute_qparams` shapes them for the spec ([N, 1] channel, [N, K/g] group, [] tensor)."""

    def __init__(self, W: torch.Tensor, spec: QuantSpec, qparams=compute_qparams):
        """W [N, K]; qparams(x, spec) -> (scale, zero): compute_qparams or search_qparams."""
        if spec.granularity == "token":
            raise LeanLMError("granularity='token' is for activations; quantize weights per 'channel', 'group' "
                              "or 'tensor'")
        spec.check(W)
        N, K = W.shape
        self.qparams = qparams
        self.col_spec = replace(spec, granularity="channel", group_size=None)  # one column [N, 1] at a time
        self.group_size = spec.group_size if spec.granularity == "group" else None
        if self.group_size:
            self.scale = torch.zeros(N, K // self.group_size, dtype=torch.float32, device=W.device)
            self.zero = torch.zeros(N, K // self.group_size, dtype=torch.int32, device=W.device)
            self._fitted = [False] * (K // self.group_size)
        else:
            self.scale, self.zero = qparams(W, spec)

    def needs_fit(self, k: int) -> bool:
        """Whether column k's group has no grid yet (never, per channel or tensor)."""
        return self.group_size is not None and not self._fitted[k // self.group_size]

    def fit(self, k: int, weights: torch.Tensor) -> None:
        """Fit the grid of column k's group to the group's weights [N, group_size] (pruned ones as 0)."""
        g = k // self.group_size
        self.scale[:, g:g + 1], self.zero[:, g:g + 1] = self.qparams(weights, self.col_spec)
        self._fitted[g] = True

    def round(self, w: torch.Tensor, k: int) -> torch.Tensor:
        """Column k's weights w [N, 1] moved to the nearest point of its grid  # [N, 1] -> [N, 1]"""
        if self.group_size:
            g = k // self.group_size
            scale, zero = self.scale[:, g:g + 1], self.zero[:, g:g + 1]
        else:
            scale, zero = self.scale.expand(w.shape[0], 1), self.zero.expand(w.shape[0], 1)
        return dequantize(quantize(w, scale, zero, self.col_spec), scale, zero, self.col_spec)
