"""compare: quality and size of quantized variants against their base, and the CLI verb."""

import json
import os

import pytest
import torch

from leanlm.bench.compare import quality, speed
from leanlm.compress.quant import format as qformat
from leanlm.compress.quant.rtn import RTN
from leanlm.compress.registry import apply
from leanlm.errors import LeanLMError
from leanlm.models.loading import load_model
from tests.conftest import make_hf_model, make_tokenizer
from tests.test_cli import leanlm


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """A tiny base model and its RTN W8A16 and W4A16 variants, as directories."""
    root = tmp_path_factory.mktemp("compare")
    base = root / "base"
    make_hf_model("llama", base, intermediate_size=64)
    make_tokenizer(base)
    dirs = [str(base)]
    for config in (RTN(8), RTN(4, 32)):
        model = load_model(base, torch.bfloat16)
        out = root / f"w{config.bits}"
        out.mkdir()
        qformat.save(model, apply(model, config), config, base, out)
        dirs.append(str(out))
    text = root / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog, hello world. " * 30)
    return dirs, text


def test_quality_rows(variants):
    dirs, text = variants
    base, w8, w4 = quality(dirs[0], dirs[1:], "bfloat16", "cpu", max_tokens=400, data=text)
    assert base.kl == 0 and base.top1 == 1 and base.bits_per_weight == pytest.approx(16)
    assert base.tokens == w8.tokens == w4.tokens > 100
    assert 0 < w8.kl < w4.kl and 0.9 < w4.top1 <= 1 and 0.9 < w8.top1 <= 1  # near-flat logits: ties decide top-1
    assert 16 > w8.bits_per_weight > w4.bits_per_weight
    assert all((row.sparsity, row.pattern) == (0.0, None) for row in (w8, w4))  # dense: no code is a pruned weight
    for row in (base, w8, w4):  # resident weights follow the formula (scales are the difference)
        assert row.formula_mb <= row.memory_mb <= 1.1 * row.formula_mb
    for row in (w8, w4):  # saved as they are resident (the base directory holds float32 weights); the safetensors
        assert row.disk_mb == pytest.approx(row.memory_mb, rel=0.1)  # header's few KB are ~6% of this tiny model


def test_speed_runs_bench_in_a_fresh_process(variants):
    r = speed(variants[0][2], "bfloat16", threads=1, compiled=False, new_tokens=4)
    assert r["tokens_per_s"] > 0 and 0 < r["mbu"]
    with pytest.raises(LeanLMError):
        speed(str(variants[1] / "missing"), "bfloat16", threads=1, compiled=False, new_tokens=4)


def test_compare_cli_json(variants):
    dirs, text = variants
    r = leanlm("compare", *dirs, "--data", text, "--max-tokens", "300", "--no-speed", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["model"] for row in rows] == dirs and rows[0]["kl"] == 0 and rows[2]["kl"] > 0
    r = leanlm("compare", *dirs, "--data", text, "--max-tokens", "300", "--no-speed")  # a pipe: rich's 80 columns
    assert r.returncode == 0, r.stderr
    assert all(f"{row['perplexity']:.3f}" in r.stdout for row in rows), r.stdout  # whole numbers, not cut to fit
    r = leanlm("compare", dirs[0], dirs[1], "--data", text, "--max-tokens", "300", "--eager", "--threads", "1",
               env={**os.environ, "COLUMNS": "250"})
    assert r.returncode == 0, r.stderr
    assert "bits/weight" in r.stdout and "tok/s" in r.stdout


def test_compare_shows_each_models_sparsity(variants, tmp_path):
    from leanlm.pipeline import make_config
    from leanlm.compress.sparse.save import save_float

    dirs, text = variants
    model = load_model(dirs[0], torch.float32)
    apply(model, make_config("magnitude", {"pattern": "2:4"}))
    pruned = tmp_path / "pruned"
    pruned.mkdir()
    save_float(model, dirs[0], pruned)
    base, row = quality(dirs[0], [str(pruned)], "bfloat16", "cpu", max_tokens=200, data=text)
    assert (base.sparsity, base.pattern) == (0.0, None) and (row.sparsity, row.pattern) == (0.5, "2:4")
    r = leanlm("compare", dirs[0], pruned, "--data", text, "--max-tokens", "200", "--no-speed")
    assert r.returncode == 0 and "sparsity" in r.stdout and "50% 2:4" in r.stdout, r.stdout


def test_compare_and_info_name_the_lm_head(variants, tmp_path):
    from leanlm.pipeline import make_config

    dirs, text = variants
    model = load_model(dirs[0], torch.bfloat16)
    configs, records = [RTN(4, 32), make_config("lm_head", {"bits": 8})], {}
    for config in configs:
        records |= apply(model, config)
    head8 = tmp_path / "head8"
    head8.mkdir()
    qformat.save(model, records, configs, dirs[0], head8)
    rows = quality(dirs[0], [dirs[2], str(head8)], "bfloat16", "cpu", max_tokens=200, data=text)
    assert [row.lm_head for row in rows] == ["bfloat16, tied", "bfloat16, tied", "int8 (w8a16)"]
    r = leanlm("info", head8)
    assert r.returncode == 0 and "lm_head" in r.stdout and "int8 (w8a16)" in r.stdout, r.stdout
