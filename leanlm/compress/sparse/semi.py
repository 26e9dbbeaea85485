"""2:4-sparse weights on NVIDIA GPUs (Ampere and later) as torch's semi-structured sparse tensors, whose products
run cuSPARSELt or CUTLASS sparse kernels that skip the zeros (torch.sparse.to_sparse_semi_structured)."""

from __future__ import annotations

import torch
from torch.sparse import to_sparse_semi_structured

from leanlm.compress.registry import decoder_linears
from leanlm.lowbit.sparse24 import is_24


def semi_structured(model) -> list[str]:
    """Hold each decoder projection of `model` whose weight is 2:4 sparse along its inputs as a semi-structured
    tensor (16-bit weights on CUDA); returns the names converted. Others stay dense: weights on the CPU, other
    dtypes, and shapes the sparse kernels cannot take (rows not a multiple of 32, inputs not of 64)."""
    converted = []
    for name, linear in decoder_linears(model):
        w = linear.weight
        N, K = w.shape
        if w.device.type != "cuda" or w.dtype not in (torch.float16, torch.bfloat16) or N % 32 or K % 64:
            continue
        if is_24(w.detach()):
            linear.weight = torch.nn.Parameter(to_sparse_semi_structured(w.detach()), requires_grad=False)
            converted.append(name)
    return converted
