"""QAT: a fake-quantized projection computes what its export computes, passes gradients straight through, and
distillation with it lowers the quantized model's KL to the float one; the export loads like `leanlm quantize`'s."""

from __future__ import annotations

import pytest
import torch

from leanlm.distillation.qat import QAT, FakeQuantLinear, export, prepare, straight_through
from leanlm.distillation.trainer import DistillConfig, Trainer
from leanlm.compress.quant import format as qformat
from leanlm.compress.registry import decoder_linears
from leanlm.errors import LeanLMError
from leanlm.lowbit.primitives import QuantSpec
from leanlm.models.loading import load_model
from tests.distillation.test_trainer import IDS
from tests.conftest import make_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qat")
    make_hf_model("llama", path, seed=3)
    return path


@pytest.mark.parametrize("scheme", ["w8", "w8a8", "w4g32"])
def test_a_fake_quantized_projection_computes_what_its_export_computes(model_dir, scheme):
    model = load_model(model_dir, torch.float32)
    config = QAT.parse(scheme)
    prepare(model, config)
    x = torch.randn(3, 5, 64)
    before = {name: m(x) for name, m in decoder_linears(model) if name.endswith("o_proj")}
    export(model, config)
    for name, y in before.items():
        exported = model.get_submodule(name)
        assert exported.SCHEME == config.scheme
        torch.testing.assert_close(exported._reference(x.bfloat16()).float(), y, rtol=0.02, atol=0.02)
    if scheme == "w8":  # the same grid, the bf16 scale included: the weights agree exactly
        from leanlm.lowbit.linear import W8A16Linear

        layer = FakeQuantLinear(torch.nn.Linear(64, 32), config)
        w = straight_through(layer.weight, layer.spec, layer.scale_dtype)
        assert torch.equal(w.detach(), W8A16Linear.from_float(layer).dequantized_weight())


def test_gradients_pass_the_rounding_unchanged():
    w = torch.randn(8, 16, requires_grad=True)
    out = straight_through(w, QuantSpec(4, symmetric=False, granularity="group", group_size=8))
    assert not torch.equal(out, w)
    (out * 3).sum().backward()
    assert torch.equal(w.grad, torch.full_like(w, 3.0))


def test_qat_distillation_lowers_the_kl_and_exports_a_loadable_model(model_dir, tmp_path):
    teacher, student = load_model(model_dir, torch.float32), load_model(model_dir, torch.float32)
    config = QAT.parse("w4g32")
    prepare(student, config)
    trainer = Trainer(teacher, student, IDS, IDS[-600:], DistillConfig(batch_size=2, seq_len=16, lr=1e-4, warmup=2,
                                                                       steps=30, eval_every=30, autocast=False))
    history = trainer.run(progress=False)
    assert history.evals[-1]["kl"] < history.evals[0]["kl"]
    records = export(student, config)
    qformat.save(student, records, [config], model_dir, tmp_path)
    loaded = load_model(tmp_path, torch.bfloat16)
    tokens = IDS[:12][None]
    positions = torch.arange(12)[None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens, positions).float(), student(tokens, positions).float())


def test_bad_schemes_and_quantized_students_are_refused(model_dir):
    with pytest.raises(LeanLMError, match="w4g128"):
        QAT.parse("w3")
    with pytest.raises(LeanLMError):
        QAT.parse("w4g48")
    model = load_model(model_dir, torch.float32)
    export(model, QAT.parse("w8"))
    with pytest.raises(LeanLMError, match="float"):
        prepare(model, QAT.parse("w8"))
