"""Per-layer sensitivity and mixed precision: the knapsack is exact (against brute force), measuring one projection
leaves the model as it was, and a mixed assignment becomes an RTN config whose per-layer bits save and load."""

import itertools
import json
import random

import pytest
import torch

from leanlm.compress.quant import format as qformat
from leanlm.compress.registry import apply, decoder_linears
from leanlm.pipeline import read_recipe
from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import W4A16Linear, W8A16Linear
from leanlm.lowbit.record import RECORD
from leanlm.models.layers import Linear
from leanlm.models.loading import load_model
from leanlm.optimize.sensitivity import (Prune, Quantize, Sensitivity, assign_bits, assignment_bytes, layer_sensitivity,
                                         mixed_assignment, mixed_config, mixed_recipe, parse_option, predicted_kl,
                                         sensitivity_chart)
from tests.conftest import make_hf_model

IDS = torch.randint(3, 128, (96,), generator=torch.Generator().manual_seed(0))


def brute_force(costs, sizes, budget):
    """Least total cost over every assignment that fits, or None."""
    fits = [sum(c[k] for c, k in zip(costs, ks)) for ks in itertools.product(*(range(len(c)) for c in costs))
            if sum(s[k] for s, k in zip(sizes, ks)) <= budget]
    return min(fits, default=None)


def test_knapsack_matches_brute_force_on_random_instances():
    rng = random.Random(0)
    for _ in range(300):
        units, options = rng.randint(1, 5), rng.randint(1, 3)
        costs = [[rng.random() for _ in range(options)] for _ in range(units)]
        sizes = [[rng.randint(1, 12) for _ in range(options)] for _ in range(units)]
        budget = rng.randint(sum(map(min, sizes)), sum(map(max, sizes)) + 2)
        chosen = assign_bits(costs, sizes, budget)
        assert sum(s[k] for s, k in zip(sizes, chosen)) <= budget
        assert sum(c[k] for c, k in zip(costs, chosen)) == pytest.approx(brute_force(costs, sizes, budget))


def test_knapsack_with_coarse_cells_still_fits_the_budget():
    rng = random.Random(1)
    for _ in range(50):
        costs = [[rng.random(), rng.random() / 10] for _ in range(8)]
        sizes = [[rng.randint(1000, 5000), rng.randint(6000, 20000)] for _ in range(8)]
        budget = rng.randint(sum(map(min, sizes)), sum(map(max, sizes)))
        chosen = assign_bits(costs, sizes, budget, max_cells=7)  # r = hundreds of bytes: sizes rounded up
        assert sum(s[k] for s, k in zip(sizes, chosen)) <= budget
        assert sum(c[k] for c, k in zip(costs, chosen)) >= brute_force(costs, sizes, budget) - 1e-12
    with pytest.raises(LeanLMError, match="below the smallest"):
        assign_bits([[1.0, 0.0]], [[10, 20]], 9)
    with pytest.raises(LeanLMError, match="finite cost"):
        assign_bits([[float("inf"), 0.0]], [[10, 20]], 15)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("src")
    make_hf_model("llama", path)
    return path, load_model(path, torch.float32)


@pytest.fixture(scope="module")
def measured(tiny_model):
    _, model = tiny_model
    positions = torch.arange(48)[None]
    before = model(IDS[None, :48], positions)
    result = layer_sensitivity(model, IDS, [Quantize(4, 32), Quantize(8), Prune(0.5)], window=48)
    assert torch.equal(model(IDS[None, :48], positions), before)  # every projection put back as it was
    assert all(isinstance(m, Linear) for _, m in decoder_linears(model))
    return result


def test_sensitivity_measures_each_projection_alone(measured, tiny_model):
    _, model = tiny_model
    assert [u.name for u in measured.units] == [n for n, _ in decoder_linears(model)]
    assert measured.tokens == 96  # two windows of 48
    for u in measured.units:
        assert set(u.kl) == {"w4g32", "w8", "prune50"} and u.kl["w4g32"] > 0 and u.kl["prune50"] > 0
        assert u.kl["w8"] < u.kl["w4g32"]  # 8 bits change the output less than 4
        assert u.bytes["w8"] > u.bytes["w4g32"] and u.bytes["prune50"] == u.float_bytes
        assert u.bytes["w4g32"] == u.params // 2 + 2 * 2 * u.params // 32  # codes + bf16 scale and zero per group
    # running layers i.. from the float model's cached inputs gives the KL of a whole forward of the changed model
    name = "layers.0.self_attn.o_proj"
    changed = load_model(tiny_model[0], torch.float32)
    apply(changed, mixed_config({n: "w4g32" if n == name else "float" for n, _ in decoder_linears(model)}))
    kl = 0.0
    for w in IDS.view(2, 48):
        logp = model(w[None], torch.arange(48)[None])[0].log_softmax(-1)
        logq = changed(w[None], torch.arange(48)[None])[0].log_softmax(-1)
        kl += (logp.exp() * (logp - logq)).sum().item()
    assert kl / 96 == pytest.approx(measured.unit(name).kl["w4g32"], rel=1e-3)


def test_result_round_trips_json_and_draws(measured, tmp_path):
    again = Sensitivity.from_dict(json.loads(json.dumps(measured.to_dict())))
    assert again == measured
    sensitivity_chart(measured, tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_mixed_assignment_spends_the_budget_on_the_most_sensitive(measured):
    options = ["w4g32", "w8"]
    low = assignment_bytes(measured, {u.name: "w4g32" for u in measured.units})
    high = assignment_bytes(measured, {u.name: "w8" for u in measured.units})
    budget = (low + high) / 2
    mix = mixed_assignment(measured, options, budget_bytes=budget)
    assert assignment_bytes(measured, mix) <= budget and set(mix.values()) == {"w4g32", "w8"}
    # no other assignment within the budget has a lower summed KL
    names = [u.name for u in measured.units]
    for picks in itertools.product(options, repeat=len(names)):
        other = dict(zip(names, picks))
        if assignment_bytes(measured, other) <= budget:
            assert predicted_kl(measured, mix) <= predicted_kl(measured, other) + 1e-12
    by_bits = mixed_assignment(measured, options, avg_bits=budget * 8 / measured.params)
    assert by_bits == mix
    with pytest.raises(LeanLMError, match="not measured"):
        mixed_assignment(measured, ["w4g128"], avg_bits=8)


def test_mixed_config_applies_per_layer_bits_and_survives_save_and_load(tiny_model, tmp_path):
    src, _ = tiny_model
    names = [n for n, _ in decoder_linears(load_model(src, torch.float32))]
    assignment = {n: "w4g32" for n in names} | {names[0]: "w8", names[2]: "w4g64", names[5]: "float"}
    config = mixed_config(assignment)
    assert (config.bits, config.group_size) == (4, 32)
    assert config.layers == {names[0]: 8, names[2]: {"bits": 4, "group_size": 64}, names[5]: 16}
    model = load_model(src, torch.bfloat16)
    records = apply(model, config)
    assert names[5] not in records

    def check(m):
        for n in names:
            module = m.get_submodule(n)
            want = parse_option(assignment[n])
            if want is None:
                assert isinstance(module, Linear)
            elif want.bits == 8:
                assert isinstance(module, W8A16Linear)
            else:
                assert isinstance(module, W4A16Linear) and module.group_size == want.group_size

    check(model)
    out = tmp_path / "q"
    out.mkdir()
    qformat.save(model, records, config, src, out)
    assert json.loads((out / RECORD).read_text())["recipe"][0]["layers"] == config.layers
    again = load_model(out, torch.bfloat16)
    check(again)
    tokens, positions = IDS[None, :20], torch.arange(20)[None]
    assert torch.equal(model(tokens, positions), again(tokens, positions))
    recipe = tmp_path / "mixed.yaml"  # the same assignment as a file for `leanlm quantize --recipe`
    recipe.write_text(mixed_recipe(assignment))
    assert read_recipe(recipe) == [config]


def test_options_parse_and_refuse():
    assert [parse_option(n) for n in ("w8", "w4g64", "prune50", "float")] == [Quantize(8), Quantize(4, 64),
                                                                              Prune(0.5), None]
    for bad in ("w4g48", "w6", "prune0"):
        with pytest.raises(LeanLMError, match="unknown sensitivity option"):
            parse_option(bad)
    with pytest.raises(LeanLMError, match="rtn applies"):
        mixed_config({"layers.0.mlp.down_proj": "prune50"})
