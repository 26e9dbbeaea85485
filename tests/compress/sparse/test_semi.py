"""2:4 weights as torch's semi-structured sparse tensors on CUDA; on the CPU nothing changes."""

from __future__ import annotations

import pytest
import torch

from leanlm.compress.registry import apply
from leanlm.pipeline import make_config
from leanlm.compress.sparse.semi import semi_structured
from leanlm.models.loading import load_model


def _logits(model):
    ids = torch.arange(1, 33, device=model.device)[None]
    with torch.no_grad():
        return model(ids, torch.arange(32, device=model.device)[None], None).float()


def test_on_the_cpu_nothing_is_converted(tiny_dir):
    model = load_model(tiny_dir, torch.bfloat16)
    apply(model, make_config("magnitude", {"pattern": "2:4"}))
    before = _logits(model)
    assert semi_structured(model) == [] and torch.equal(_logits(model), before)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                    reason="semi-structured sparsity needs an Ampere or later NVIDIA GPU")
def test_a_24_model_on_cuda_computes_the_same_logits(tiny_dir):
    model = load_model(tiny_dir, torch.float16, torch.device("cuda"))
    apply(model, make_config("magnitude", {"pattern": "2:4"}))
    before = _logits(model)
    converted = semi_structured(model)
    assert converted and all(n.endswith(("qkv_proj", "o_proj", "gate_up_proj")) for n in converted)  # down: K=96
    torch.testing.assert_close(_logits(model), before, atol=2e-2, rtol=2e-2)
