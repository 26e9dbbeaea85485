"""k-quants: the bytes leanlm writes are what the gguf package's dequantizers read back, bit for bit; the fit beats
naive rounding and uses the importance matrix; the mixtures pick llama-quantize's types; the file loads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from gguf.quants import quantize as naive_quantize

from leanlm.compress.quant import kquants
from leanlm.compress.quant.gguf_export import export_gguf, importance_matrix
from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import W8A16Linear
from leanlm.models.gguf import convert_gguf, open_gguf
from leanlm.models.loading import load_model
from tests.compress.test_gguf_export import logits, source  # noqa: F401 (the fixture)

TYPES = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q4_0, Q.Q5_0, Q.Q5_1, Q.Q8_0]


def weights(N: int = 48, K: int = 512) -> torch.Tensor:
    """Gaussian rows with the cases a fit can trip on: an outlier, an all-zero row, an all-positive row."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g) * 0.02
    w[3, 7] = 0.5
    w[5] = 0
    w[6] = w[6].abs()
    return w


def importance(K: int = 512) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    m = torch.rand(K, generator=g) ** 4 * 10
    m[:40] = 0  # columns no token ever used
    return m


def read_back(blocks: np.ndarray, qtype: Q, shape) -> torch.Tensor:
    return torch.from_numpy(np.asarray(dequantize(blocks, qtype), dtype=np.float32)).reshape(shape)


def rel_error(w: torch.Tensor, back: torch.Tensor, imatrix: torch.Tensor | None = None) -> float:
    m = torch.ones(w.shape[1]) if imatrix is None else imatrix
    return float(((back - w) ** 2 * m).sum() / (w ** 2 * m).sum())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("with_matrix", [False, True], ids=["plain", "imatrix"])
def test_bytes_dequantize_to_what_the_fit_computed(qtype, with_matrix):
    w, m = weights(), importance() if with_matrix else None
    blocks, back = kquants.quantize(w, qtype, m)
    block, size = GGML_QUANT_SIZES[qtype]
    assert blocks.dtype == np.uint8 and blocks.shape == (w.shape[0], w.shape[1] // block * size)
    assert torch.equal(read_back(blocks, qtype, w.shape), back)
    assert not back[5].any()  # an all-zero row stays zero
    assert rel_error(w, back, m) < 0.1  # weighed as fitted: columns of importance 0 may go to 0


def test_more_bits_less_error_and_the_fit_beats_naive_rounding():
    w = weights()
    errors = [rel_error(w, kquants.quantize(w, q)[1]) for q in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)]
    assert errors == sorted(errors, reverse=True)
    for qtype in (Q.Q4_0, Q.Q5_0, Q.Q5_1):  # the gguf package's round-to-nearest from the block's range
        naive = read_back(naive_quantize(w.numpy(), qtype), qtype, w.shape)
        assert rel_error(w, kquants.quantize(w, qtype)[1]) < 0.95 * rel_error(w, naive), qtype.name


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q6_K, Q.Q5_0], ids=lambda q: q.name)
def test_the_importance_matrix_moves_error_off_the_columns_that_matter(qtype):
    w, m = weights(), importance()
    plain = rel_error(w, kquants.quantize(w, qtype)[1], m)
    weighted = rel_error(w, kquants.quantize(w, qtype, m)[1], m)
    assert weighted < 0.95 * plain


def test_rows_a_block_does_not_divide_are_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        kquants.quantize(torch.randn(4, 576), Q.Q4_K)


def test_mixtures_choose_llama_quantizes_types():
    def kinds(mixture, K, n=30, gqa=3, tied=True):
        names = ["token_embd.weight"] + [f"blk.{i}.{p}.weight" for i in range(n)
                                         for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                                   "ffn_down")]
        return {name: kquants.tensor_type(mixture, name, K, n, gqa, tied) for name in names}

    # SmolLM2-135M (30 layers, K = 576 but ffn_down's 1536): the counts llama-quantize Q4_K_M printed for it
    t = kinds("Q4_K_M", 576)
    for i in range(30):
        t[f"blk.{i}.ffn_down.weight"] = kquants.tensor_type("Q4_K_M", f"blk.{i}.ffn_down.weight", 1536, 30, 3, True)
    counts = {q: list(t.values()).count(q) for q in set(t.values())}
    assert counts == {Q.Q4_K: 16, Q.Q5_0: 166, Q.Q6_K: 14, Q.Q8_0: 15}
    t = kinds("Q4_K_M", 1024, n=8)  # use_more_bits at 8 layers: the first, the last, and layer 3 (1 + 3k - 1)
    assert [i for i in range(8) if t[f"blk.{i}.attn_v.weight"] == Q.Q6_K] == [0, 3, 6, 7]
    assert t["token_embd.weight"] == Q.Q6_K and t["blk.2.attn_q.weight"] == Q.Q4_K
    t = kinds("Q2_K", 1024, n=8, gqa=7, tied=False)
    assert t["blk.0.attn_v.weight"] == Q.Q4_K and t["blk.0.ffn_down.weight"] == Q.Q3_K
    assert t["blk.0.attn_q.weight"] == Q.Q2_K and t["token_embd.weight"] == Q.Q2_K
    assert kinds("Q2_K", 1024, gqa=3)["blk.0.attn_v.weight"] == Q.Q3_K
    t = kinds("Q3_K_M", 1024, n=32)
    assert [t[f"blk.{i}.attn_v.weight"] for i in (0, 1, 2)] == [Q.Q5_K, Q.Q5_K, Q.Q4_K]
    assert [t[f"blk.{i}.ffn_down.weight"] for i in (1, 2)] == [Q.Q5_K, Q.Q4_K]
    assert t["blk.9.attn_output.weight"] == Q.Q4_K and t["blk.9.ffn_up.weight"] == Q.Q3_K
    assert kinds("Q3_K_M", 96)["blk.9.ffn_up.weight"] == Q.Q4_0  # the 32-weight fallback


def test_importance_matrix_is_the_mean_square_of_each_layers_input(source):  # noqa: F811
    _, path = source
    model = load_model(path, torch.float32)
    samples = torch.randint(0, model.config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    matrix = importance_matrix(model, samples)
    with torch.no_grad():
        first = model.layers[0].input_layernorm(model.embed_tokens(samples))  # what q, k and v read
        final = model.norm(model.hidden(samples, torch.arange(16)[None].expand(3, 16)))  # what the output reads
    want = first.reshape(-1, first.shape[-1]).square().mean(0)
    for part in ("attn_q", "attn_k", "attn_v"):
        torch.testing.assert_close(matrix[f"blk.0.{part}.weight"], want)
    head = "token_embd.weight" if model.lm_head_is_embedding else "output.weight"
    torch.testing.assert_close(matrix[head], final.reshape(-1, final.shape[-1]).square().mean(0))
    assert len(matrix) == 7 * model.config.num_layers + 1


def test_k_quant_export_loads_back_close_to_the_float_model(source, tmp_path):  # noqa: F811
    _, path = source
    model = load_model(path, torch.bfloat16)
    samples = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    written = export_gguf(model, path, tmp_path / "q.gguf", mixture="Q4_K_M",
                          imatrix=importance_matrix(model, samples))
    assert {"Q5_0", "F32"} <= set(written.types)  # the tiny model's rows (64, 96) take the 32-weight fallbacks
    assert open_gguf(tmp_path / "q.gguf").fields["general.file_type"].parts[-1][0] == 15  # MOSTLY_Q4_K_M
    convert_gguf(tmp_path / "q.gguf", tmp_path / "back", progress=False)
    ref = logits(model.float())
    assert (logits(load_model(tmp_path / "back", torch.float32)) - ref).abs().max() < 0.1 * ref.abs().max()


def test_k_quants_are_made_from_float_weights(source, tmp_path):  # noqa: F811
    _, path = source
    model = load_model(path, torch.bfloat16)
    model.layers[0].mlp.down_proj = W8A16Linear.from_float(model.layers[0].mlp.down_proj)
    with pytest.raises(LeanLMError, match="made from a float model"):
        export_gguf(model, path, tmp_path / "x.gguf", mixture="Q4_K_M")
    assert not list(tmp_path.iterdir())


def test_cli_export_k_quant(source, tmp_path):  # noqa: F811
    import subprocess

    from leanlm.bench.serve import leanlm_command

    _, path = source

    def leanlm(*args):
        return subprocess.run(leanlm_command(*map(str, args)), capture_output=True, text=True)

    r = leanlm("export", path, "--format", "gguf", "--type", "Q3_K_M", "--imatrix", "--samples", "2",
               "--seq-len", "16", "-o", tmp_path / "m.gguf")
    assert r.returncode == 0, r.stderr
    assert "Q4_0" in r.stdout and {t.tensor_type for t in open_gguf(tmp_path / "m.gguf").tensors} >= {Q.Q4_0}
    r = leanlm("export", path, "--format", "gguf", "--type", "Q4_K_S", "-o", tmp_path / "n.gguf")
    assert r.returncode == 2 and "Q2_K, Q3_K_M, Q4_K_M, Q5_K_M, Q6_K" in r.stderr and "Traceback" not in r.stderr
    r = leanlm("export", path, "--format", "gguf", "--imatrix", "-o", tmp_path / "n.gguf")
    assert r.returncode == 2 and "give --type too" in r.stderr
    r = leanlm("export", path, "--format", "gguf", "--type", "Q4_K_M", "--imatrix-file", tmp_path / "m.gguf",
               "-o", tmp_path / "n.gguf")
    assert r.returncode == 2 and "not an importance matrix" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "n.gguf").exists()


def test_an_importance_matrix_from_llama_imatrix_is_read(source, tmp_path):  # noqa: F811
    from gguf import GGUFWriter

    from leanlm.compress.quant.gguf_export import read_imatrix

    _, path = source
    model = load_model(path, torch.bfloat16)
    samples = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    ours = importance_matrix(model, samples)
    writer = GGUFWriter(tmp_path / "imatrix.gguf", "")  # llama-imatrix's layout: sums of squares and token counts
    writer.add_type("imatrix")
    for name, mean in ours.items():
        writer.add_tensor(f"{name}.in_sum2", (mean * 32).numpy())
        writer.add_tensor(f"{name}.counts", np.array([32.0], dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    back = read_imatrix(tmp_path / "imatrix.gguf")
    assert back.keys() == ours.keys() and all(torch.allclose(back[k], ours[k]) for k in ours)
    with pytest.raises(LeanLMError, match="made for another model"):
        export_gguf(model, path, tmp_path / "x.gguf", mixture="Q4_K_M",
                    imatrix={"blk.0.attn_q.weight": torch.ones(3)})
    export_gguf(model, path, tmp_path / "m.gguf")  # a model's GGUF, not an importance matrix
    with pytest.raises(LeanLMError, match="not an importance matrix"):
        read_imatrix(tmp_path / "m.gguf")
