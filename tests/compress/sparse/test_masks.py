"""Masks are exact: per-row counts to one weight, N:M groups, one count over a layer or several tensors; OWL's
per-layer sparsities keep their mean; bad sparsities and patterns fail with one clear message."""

from __future__ import annotations

import pytest
import torch

from leanlm.compress.sparse.masks import (check_pattern_fits, check_sparsity, decoder_sparsity, global_masks,
                                          layer_mask, module_sparsity, nm_mask, owl_sparsities, parse_pattern,
                                          pattern_sparsity, row_mask)
from leanlm.errors import LeanLMError
from leanlm.lowbit.record import note_pruning


def _scores(*shape, seed=0):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("sparsity", [0.0, 0.1, 0.3, 0.5, 0.77, 0.99])
def test_row_mask_prunes_the_lowest_exactly_per_row(sparsity):
    score = _scores(16, 37)
    mask = row_mask(score, sparsity)
    assert (mask.sum(1) == round(sparsity * 37)).all()
    pruned_max = score.masked_fill(~mask, -1).amax(1)
    kept_min = score.masked_fill(mask, 2).amin(1)
    assert (pruned_max < kept_min).all()


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (1, 4), (3, 4)])
def test_nm_mask_prunes_m_minus_n_of_every_group(n, m):
    score = _scores(8, 64)
    groups = nm_mask(score, n, m).reshape(8, 64 // m, m)
    assert (groups.sum(-1) == m - n).all()
    s = score.reshape(8, 64 // m, m)
    assert (s.masked_fill(~groups, -1).amax(-1) < s.masked_fill(groups, 2).amin(-1)).all()


def test_layer_and_global_masks_count_exactly_with_one_threshold():
    a, b = _scores(8, 16, seed=1), 3 * _scores(4, 10, seed=2)  # b's scores are larger: it loses fewer
    mask = layer_mask(a, 0.4)
    assert mask.sum() == round(0.4 * a.numel())
    ma, mb = global_masks([a, b], 0.5)
    assert ma.sum() + mb.sum() == round(0.5 * (a.numel() + b.numel()))
    assert ma.float().mean() > mb.float().mean()
    pruned = torch.cat([a[ma], b[mb]])
    kept = torch.cat([a[~ma], b[~mb]])
    assert pruned.max() <= kept.min()
    ties = torch.ones(4, 5)  # equal scores: still exactly the count asked
    assert layer_mask(ties, 0.5).sum() == 10


def test_owl_sparsities_keep_the_mean_and_spare_outlier_layers():
    s = owl_sparsities([0.01, 0.05, 0.02, 0.10], 0.6, lam=0.08)
    assert sum(s) / 4 == pytest.approx(0.6)
    assert max(s) - min(s) == pytest.approx(0.16)
    assert s[3] == min(s) and s[0] == max(s)  # the layer with most outliers is pruned least
    assert owl_sparsities([0.3, 0.3], 0.5) == pytest.approx([0.5, 0.5])


@pytest.mark.parametrize("value", [1.0, -0.1, 1.5, "0.5", True])
def test_bad_sparsity(value):
    with pytest.raises(LeanLMError, match=r"in \[0, 1\)"):
        check_sparsity(value)


@pytest.mark.parametrize("text", ["2-4", "4:2", "0:4", "2:2", "a:b", "2:4:8", ""])
def test_malformed_patterns(text):
    with pytest.raises(LeanLMError, match="N:M"):
        parse_pattern(text)


def test_patterns_parse_fit_and_fix_the_sparsity():
    assert parse_pattern("2:4") == (2, 4) and parse_pattern(None) is None and parse_pattern("unstructured") is None
    assert pattern_sparsity("2:4", None) == 0.5 and pattern_sparsity("2:4", 0.5) == 0.5
    assert pattern_sparsity("4:8", None) == 0.5 and pattern_sparsity("1:4", None) == 0.75
    assert pattern_sparsity(None, None) == 0.5 and pattern_sparsity(None, 0.3) == 0.3
    with pytest.raises(LeanLMError, match="prunes 0.5 of the weights, not sparsity 0.6"):
        pattern_sparsity("2:4", 0.6)
    with pytest.raises(LeanLMError, match="divisible by 8, but layers.0.mlp.down_proj has 100"):
        check_pattern_fits((4, 8), 100, "layers.0.mlp.down_proj")
    with pytest.raises(LeanLMError, match="divisible by 4"):
        nm_mask(_scores(2, 10), 2, 4)


@pytest.mark.parametrize("options,expected", [
    ({"sparsity": 0.0}, (0.0, None)), ({"sparsity": 0.5}, (0.5, None)),  # 2:4 by chance on every row: ~never
    ({"pattern": "2:4"}, (0.5, "2:4")), ({"pattern": "4:8"}, (0.5, "4:8")), ({"pattern": "1:4"}, (0.75, "1:4"))])
def test_decoder_sparsity_and_the_pattern_every_projection_follows(tiny, options, expected):
    import copy

    from leanlm.compress.registry import apply
    from leanlm.pipeline import make_config

    model = copy.deepcopy(tiny[0])
    records = apply(model, make_config("magnitude", options))
    assert decoder_sparsity(model) == pytest.approx(expected)
    if expected[1] == "2:4":  # quantized, what the pruning did is its record (int4 codes cannot say)
        apply(model, make_config("rtn", {"bits": 4, "group_size": 32}))
        note_pruning(model, records)
        assert decoder_sparsity(model) == pytest.approx(expected)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_dense_quantized_model_shows_no_sparsity(tiny, tmp_path, bits):
    """Dense RTN codes at the zero point (int4: ~11% of them) or at 0 (int8) are not pruned weights: no sparsity,
    no table in `leanlm info`, "-" in `leanlm compare`; the same model pruned 2:4 first shows its pruning, in
    memory and loaded from disk."""
    import copy

    from leanlm.analysis.report import sparsity_table
    from leanlm.compress.quant import format as qformat
    from leanlm.compress.registry import apply
    from leanlm.pipeline import make_config
    from leanlm.models.loading import load_model
    from tests.conftest import make_hf_model

    rtn = make_config("rtn", {"bits": bits, "group_size": 32} if bits == 4 else {"bits": 8})
    dense = copy.deepcopy(tiny[0])
    apply(dense, rtn)
    assert decoder_sparsity(dense) == (0.0, None) and sparsity_table(dense) is None
    assert all(module_sparsity(m) == 0 for _, m in dense.named_modules() if hasattr(m, "BITS"))
    pruned = copy.deepcopy(tiny[0])
    records = apply(pruned, make_config("magnitude", {"pattern": "2:4"}))
    records = {name: {**records.get(name, {}), **q} for name, q in apply(pruned, rtn).items()}
    make_hf_model("llama", tmp_path / "src", max_position_embeddings=512)
    qformat.save(pruned, records, [rtn], tmp_path / "src", tmp_path)
    assert decoder_sparsity(load_model(tmp_path, torch.float32)) == pytest.approx((0.5, "2:4"))
