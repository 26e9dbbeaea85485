"""Loading a model directory: each weight written once, into its final place, and nothing initialised."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from leanlm.models.loading import load_model
from tests.conftest import make_hf_model

_ALIASING = {"set", "lift_fresh", "detach", "alias"}  # ops that make a tensor without writing data


class _BytesWritten(TorchDispatchMode):
    """Bytes of CPU data written by the ops run inside it (views and fresh, unwritten allocations excluded), and
    the names of the ops that made CPU tensors."""

    def __init__(self):
        super().__init__()
        self.written, self.ops = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        cpu = [o for o in (out if isinstance(out, (tuple, list)) else [out])
               if isinstance(o, torch.Tensor) and o.device.type == "cpu"]  # the meta model's init costs nothing
        if cpu:
            self.ops.add(name)
        if not func.is_view and name.rstrip("_") not in _ALIASING and not name.startswith("empty"):
            self.written += sum(o.nbytes for o in cpu)
        return out


def test_load_writes_each_weight_once_and_initialises_nothing(tmp_path):
    # float32 on disk, bfloat16 loaded, q/k/v and gate/up fused: a dtype conversion and a fusion, one pass.
    make_hf_model("llama", tmp_path, max_position_embeddings=16)  # rope tables small next to the weights
    with _BytesWritten() as log:
        model = load_model(tmp_path, torch.bfloat16)
    weights = sum(t.nbytes for t in model.state_dict().values() if t is not model.lm_head.weight)
    assert not {op for op in log.ops if any(w in op for w in ("normal", "uniform", "random", "fill"))}
    assert log.written < 1.25 * weights  # before: fused by torch.cat, converted by .to, copied to huge pages (3.5x)
    ref = load_model(tmp_path, torch.float32)
    for name, t in model.state_dict().items():
        assert torch.equal(t, ref.state_dict()[name].bfloat16()), name


def test_half_to_half_conversion_in_chunks_rounds_like_torch():
    from leanlm.models import loading

    x = torch.randn(2 * loading._CHUNK + 77, dtype=torch.float32) * 1e3
    for src, dst in ((torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)):
        dest = torch.empty(x.shape, dtype=dst)
        loading._copy(dest, x.to(src))
        assert torch.equal(dest, x.to(src).to(dst))
