import copy
import struct
from dataclasses import replace

import pytest
import torch

from leanlm.cache.static import StaticCache
from leanlm.compress.quant import format as qformat
from leanlm.compress.quant.rtn import RTN, Head
from leanlm.compress.registry import apply, decoder_linears
from leanlm.pipeline import make_config, method
from leanlm.compress.sparse.save import save_float
from leanlm.compress.sparse.slicing import kv_group_scores, merge_redundant, param_count, select_top
from leanlm.compress.sparse.structured import Heads, Layers, Neurons, calibration_loss, drop_layers
from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import W4A16Linear
from leanlm.models.loading import load_model
from tests.conftest import make_hf_model

LAYERS, INTER = 4, 96
# (arch, KV heads): GQA with tied embeddings, GQA with q/k/v biases, plain multi-head with an untied lm_head
ARCHS = [("llama", 2), ("qwen2", 2), ("mistral", 4)]


def samples(n=6, T=12, seed=0):
    return torch.randint(0, 128, (n, T), generator=torch.Generator().manual_seed(seed))


def tokens():
    return torch.randint(0, 128, (2, 15), generator=torch.Generator().manual_seed(1))


def logits(model, toks=None):
    toks = tokens() if toks is None else toks
    with torch.no_grad():
        return model(toks, torch.arange(toks.shape[1])[None].expand(len(toks), -1))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """{(arch, kv): directory} of tiny 4-layer models saved by transformers."""
    out = {}
    for arch, kv in ARCHS:
        path = tmp_path_factory.mktemp(f"{arch}{kv}")
        make_hf_model(arch, path, num_hidden_layers=LAYERS, num_key_value_heads=kv, intermediate_size=INTER)
        out[arch, kv] = path
    return out


def n_params(model):
    return sum(p.numel() for p in model.parameters())  # a tied lm_head counted once


CUTS = [Heads(heads=2), Neurons(intermediate_size=40), Neurons(intermediate_size=40, criterion="activation"),
        Neurons(intermediate_size=40, criterion="contribution"), Layers(num_layers=2),
        Layers(num_layers=3, criterion="loss")]


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"{a[0]}-kv{a[1]}")
@pytest.mark.parametrize("config", CUTS, ids=lambda c: f"{c.name}-{getattr(c, 'criterion', '')}")
def test_pruned_model_loads_in_transformers_with_equal_logits(sources, tmp_path, arch, config):
    import transformers

    model = load_model(sources[arch], torch.float32)
    before = n_params(model)
    records = apply(model, config, samples=samples())
    cfg = model.config
    assert records["model"]["params_before"] == before
    assert n_params(model) == param_count(cfg) == records["model"]["params_after"] < before
    out = tmp_path / "pruned"
    out.mkdir()
    save_float(model, sources[arch], out)
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert (ref.config.num_hidden_layers, ref.config.num_attention_heads, ref.config.num_key_value_heads,
            ref.config.intermediate_size, ref.config.head_dim) == (
        cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.head_dim)
    ours = logits(model)
    with torch.no_grad():
        theirs = ref(tokens()).logits
    assert (ours - theirs).abs().max() < 1e-4
    # and leanlm reads its own output back
    assert (logits(load_model(out, torch.float32)) - ours).abs().max() < 1e-5
    # the file holds exactly the parameters: 8-byte header length, JSON header, 4 bytes per float32
    file = out / "model.safetensors"
    header = struct.unpack("<Q", file.read_bytes()[:8])[0]
    assert file.stat().st_size == 8 + header + 4 * param_count(cfg)


@pytest.mark.parametrize("cls,unit", [(Heads, "heads"), (Neurons, "neurons"), (Layers, "layers")])
def test_target_params_is_met_within_one_unit(sources, cls, unit):
    model = load_model(sources["llama", 2], torch.float32)
    cfg = model.config
    total = param_count(cfg)
    one = total - param_count({"heads": replace(cfg, num_kv_heads=1, num_heads=2),  # one unit fewer
                               "neurons": replace(cfg, intermediate_size=INTER - 1),
                               "layers": replace(cfg, num_layers=LAYERS - 1)}[unit])
    records = apply(model, cls(target_params=0.75), samples=samples())
    assert abs(n_params(model) - 0.75 * total) <= one
    assert records["model"]["fraction_kept"] == pytest.approx(n_params(model) / total)


def test_registered_by_name():
    assert method("heads") is Heads and method("neurons") is Neurons and method("layers") is Layers
    assert make_config("neurons", {"target_params": 0.9, "criterion": "redundant"}) == Neurons(0.9, None, "redundant")


# --- selection: what the naive definition says ---


def test_select_top_keeps_highest_in_index_order():
    assert select_top(torch.tensor([0.5, 3.0, 1.0, 3.0, -1.0]), 3).tolist() == [1, 2, 3]


def test_kv_group_scores_are_each_groups_output_energy():
    g = torch.Generator().manual_seed(0)
    a, W = torch.randn(50, 24, generator=g), torch.randn(16, 24, generator=g)  # 3 groups of 8 columns
    naive = torch.stack([(a[:, s] @ W[:, s].T).square().sum() for s in (slice(0, 8), slice(8, 16), slice(16, 24))])
    assert torch.allclose(kv_group_scores(W, a.T @ a, 3).float(), naive, rtol=1e-5)


def test_heads_whose_output_is_zero_go_first_and_change_nothing(sources):
    model = load_model(sources["llama", 2], torch.float32)
    D = model.config.head_dim
    with torch.no_grad():
        for b in model.layers:  # KV group 1 = query heads 2 and 3: silence its o_proj columns
            b.self_attn.o_proj.weight[:, 2 * D:] = 0
    before = logits(model)
    records = apply(model, Heads(heads=2), samples=samples())
    assert all(records[f"layers.{i}.self_attn"]["removed_heads"] == [2, 3] for i in range(LAYERS))
    assert (logits(model) - before).abs().max() < 1e-5


def test_zero_activation_neurons_are_pruned_first(sources):
    dead = [3, 17, 40, 41, 90]
    for criterion in ("activation", "contribution", "redundant"):  # redundant: a dead neuron costs nothing
        model = load_model(sources["qwen2", 2], torch.float32)
        with torch.no_grad():
            for b in model.layers:  # gate row 0 -> silu(0) * up = 0 on every token
                b.mlp.gate_up_proj.weight[dead] = 0
        before = logits(model)
        records = apply(model, Neurons(intermediate_size=INTER - len(dead), criterion=criterion), samples=samples())
        assert all(records[f"layers.{i}.mlp"]["removed_neurons"] == dead for i in range(LAYERS))
        assert (logits(model) - before).abs().max() < 1e-5


def test_redundant_neuron_is_merged_into_its_twin(sources):
    model = load_model(sources["llama", 2], torch.float32)
    with torch.no_grad():
        for b in model.layers:  # neuron 50 duplicates neuron 7 (same gate and up rows)
            w = b.mlp.gate_up_proj.weight
            w[50], w[INTER + 50] = w[7], w[INTER + 7]
    before = logits(model)
    records = apply(model, Neurons(intermediate_size=INTER - 1, criterion="redundant"), samples=samples())
    assert all(records[f"layers.{i}.mlp"]["removed_neurons"] in ([7], [50]) for i in range(LAYERS))
    assert (logits(model) - before).abs().max() < 1e-4  # folding its down column into the twin's is exact


def test_merge_redundant_on_tensors():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(200, 6, generator=g)
    h[:, 4] = -2.5 * h[:, 1]  # collinear (sign does not matter)
    W = torch.randn(5, 6, generator=g)
    kept, merged = merge_redundant(h.T @ h, W, 5)
    assert len(kept) == 5 and (1 in kept.tolist()) != (4 in kept.tolist())
    assert torch.allclose(h[:, kept] @ merged[:, kept].T, h @ W.T, atol=1e-4)


def test_identity_layer_has_no_influence_and_goes_first(sources):
    model = load_model(sources["mistral", 4], torch.float32)
    with torch.no_grad():
        model.layers[2].self_attn.o_proj.weight.zero_()
        model.layers[2].mlp.down_proj.weight.zero_()
    before = logits(model)
    records = apply(model, Layers(num_layers=3), samples=samples())
    (removed,) = records["model"]["removed"]
    assert removed["original_layer"] == 2 and removed["block_influence"] < 1e-6
    assert min(records[f"layers.{j}"]["block_influence"] for j in range(3)) > 1e-3  # the saved model's numbers
    assert [records[f"layers.{j}"]["original_layer"] for j in range(3)] == records["model"]["kept_layers"] == [0, 1, 3]
    assert records["model"]["removed_layers"] == [2] and "layers.3" not in records
    assert (logits(model) - before).abs().max() < 1e-5


def test_records_of_every_step_name_the_saved_models_layers(sources):
    """heads, then layers (the identity layer 1 goes), then magnitude, then layers again (layer 0 goes): each
    record names a layer of the saved model, the heads record of original layer 3 has followed it to layer 1, and
    original_layer is the number in the model before any removal."""
    from leanlm.compress.registry import merge_records

    def identity(i):
        with torch.no_grad():
            model.layers[i].self_attn.o_proj.weight.zero_()
            model.layers[i].mlp.down_proj.weight.zero_()

    model = load_model(sources["mistral", 4], torch.float32)
    records = merge_records({}, apply(model, Heads(heads=2), samples=samples()))
    heads_of_3 = records["layers.3.self_attn"]
    identity(1)
    records = merge_records(records, apply(model, Layers(num_layers=3), samples=samples()))
    assert records["model"]["removed_layers"] == [1] and records["layers.2.self_attn"] == heads_of_3
    records = merge_records(records, apply(model, make_config("magnitude", {"sparsity": 0.5})))
    identity(0)
    records = merge_records(records, apply(model, Layers(num_layers=2), samples=samples()))
    assert records["model"]["removed_layers"] == [0] and model.config.num_layers == 2
    assert {int(name.split(".")[1]) for name in records if name.startswith("layers.")} == {0, 1}
    assert [records[f"layers.{j}"]["original_layer"] for j in (0, 1)] == [2, 3]
    assert records["layers.1.self_attn"] == heads_of_3
    assert all(records[name]["sparsity"] == 0.5 for name, _ in decoder_linears(model))


def test_loss_criterion_drops_the_layer_whose_removal_costs_least(sources):
    model = load_model(sources["llama", 2], torch.float32)
    x = samples()

    def loss_without(i):  # naive: really remove the layer, run the whole model
        m = copy.deepcopy(model)
        drop_layers(m, [j for j in range(LAYERS) if j != i])
        out = logits(m, x)[:, :-1]
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), x[:, 1:].flatten()).item()

    naive = [loss_without(i) for i in range(LAYERS)]
    assert naive == pytest.approx([calibration_loss(model, x, {i}) for i in range(LAYERS)], rel=1e-5)
    records = apply(model, Layers(num_layers=3, criterion="loss"), samples=x)
    best = min(range(LAYERS), key=naive.__getitem__)
    assert records["model"]["removed_layers"] == [best] and records["model"]["removed"][0]["original_layer"] == best
    assert records["model"]["removed"][0]["loss_after"] == pytest.approx(naive[best], rel=1e-5)


def test_pruned_model_decodes_with_a_kv_cache(sources):
    model = load_model(sources["qwen2", 2], torch.float32)
    apply(model, Layers(num_layers=2), samples=samples())
    apply(model, Heads(heads=2), samples=samples())
    toks = tokens()[:1]
    full = logits(model, toks)
    cache = StaticCache(model.config, 1, 32, torch.float32)
    steps = [model(toks[:, :8], torch.arange(8)[None], cache)]
    for t in range(8, toks.shape[1]):
        steps.append(model(toks[:, t: t + 1], torch.tensor([[t]]), cache))
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)


@pytest.mark.parametrize("config", [Heads(heads=2), Neurons(intermediate_size=64), Layers(num_layers=2)],
                         ids=lambda c: c.name)
def test_pruned_then_quantized_model_saves_and_loads(sources, tmp_path, config):
    """The quantized format writes the smaller shape into config.json (a copy of the source's would not load)."""
    model = load_model(sources["mistral", 4], torch.float32)  # untied lm_head: a quantized one too
    records = apply(model, config, samples=samples())
    steps = [config, RTN(4, 32), Head(8)]
    for step in steps[1:]:
        records |= apply(model, step)
    out = tmp_path / "q"
    out.mkdir()
    qformat.save(model, records, steps, sources["mistral", 4], out)
    loaded = load_model(out, torch.float32)
    assert loaded.config == model.config and isinstance(loaded.layers[0].mlp.down_proj, W4A16Linear)
    ours = logits(model)
    assert torch.isfinite(ours).all() and torch.equal(logits(loaded), ours)


# --- errors a user can cause ---


@pytest.mark.parametrize("make,match", [
    (lambda: Heads(target_params=0), r"in \(0, 1\]"),
    (lambda: Neurons(target_params=1.5), r"in \(0, 1\]"),
    (lambda: Layers(), "exactly one of"),
    (lambda: Layers(target_params=0.5, num_layers=2), "exactly one of"),
    (lambda: Neurons(intermediate_size=0), "positive whole number"),
    (lambda: Neurons(intermediate_size=8, criterion="random"), "unknown criterion"),
])
def test_bad_options_are_refused(make, match):
    with pytest.raises(LeanLMError, match=match):
        make()


@pytest.mark.parametrize("config,match", [
    (Heads(heads=8), "heads=8 is more than the 4"),
    (Heads(heads=3), "not a multiple of 2"),
    (Neurons(intermediate_size=200), "intermediate_size=200 is more than the 96"),
    (Layers(num_layers=5), "num_layers=5 is more than the 4"),
    (Layers(target_params=0.05), "cannot be reached by removing layers"),
])
def test_shapes_the_model_cannot_take_are_refused(sources, config, match):
    model = load_model(sources["llama", 2], torch.float32)
    with pytest.raises(LeanLMError, match=match):
        apply(model, config, samples=samples())
    assert model.config.num_layers == LAYERS and n_params(model) == param_count(model.config)  # untouched


def test_structured_pruning_needs_data(sources):
    model = load_model(sources["llama", 2], torch.float32)
    with pytest.raises(LeanLMError, match="needs calibration data"):
        apply(model, Neurons(target_params=0.9))
