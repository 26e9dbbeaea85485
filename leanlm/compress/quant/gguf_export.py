"""Write a model, float or quantized, as one llama.cpp GGUF file (llama.cpp and Ollama run it).

What each part becomes (N output, K input features; a GGUF block is 32 weights along a row):
- 16-bit weights stay 16-bit: bfloat16 -> BF16, float16 -> F16 (a float32 model is written F16, llama.cpp's
  default); norms and biases F32. Llama's Q/K rows are interleaved the way llama.cpp's rotary embedding reads them.
- w8a16 (and its compact 2:4 form) -> Q8_0: per block a float16 scale d and 32 int8 codes, w = d q: our codes, and
  our per-row scale in every block of the row.
- w4a16 -> Q4_1: per block float16 d and m and 32 4-bit codes, w = d q + m: our codes, our group scale s as d, and
  m = Z - 8 s (Z = (8 - z) s is the bf16 zero term we store). A layer with Z = 0 everywhere -> Q4_0, w = d (q - 8).
Every quantized layer is dequantized back from its blocks and must equal, bit for bit, the weight leanlm computes
with; a layer that does not is refused. float16 holds every bf16 scale of a normal model, but not every Q4_1 offset:
m can need 12 significant bits, one more than float16 has (1.6% of the groups of SmolLM2-135M at RTN int4, g32 or
g128). `round_offsets` accepts those offsets rounded to float16 (codes and scales still exact) and counts them.
W8A8, LLM.int8() and fp8 layers have no GGUF type and are refused.

A float model can instead be written as one of llama.cpp's k-quant mixtures (Q4_K_M and the rest: kquants.py),
quantized here from its float weights, optionally weighted by an importance matrix that `importance_matrix`
collects from calibration windows as llama-imatrix does.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_VERSION, GGUFWriter, LlamaFileType, TokenType
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from leanlm.compress.quant import kquants
from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import W4A16Linear, W8A16Linear, W8A16Sparse24Linear, quantized_layers, unpack_int4
from leanlm.models.gguf import gguf_name, permute_rotary
from leanlm.models.layers import Linear
from leanlm.models.loading import to_hf_names
from leanlm.tokenizer import Tokenizer

BLOCK = 32
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}  # model_type -> GGUF architecture
QUANTIZED = (Q.Q8_0, Q.Q4_1, Q.Q4_0)
FILE_TYPES = {Q.F16: LlamaFileType.MOSTLY_F16, Q.BF16: LlamaFileType.MOSTLY_BF16, Q.Q8_0: LlamaFileType.MOSTLY_Q8_0,
              Q.Q4_1: LlamaFileType.MOSTLY_Q4_1, Q.Q4_0: LlamaFileType.MOSTLY_Q4_0}
MIXTURE_FILE_TYPES = {"Q2_K": LlamaFileType.MOSTLY_Q2_K, "Q3_K_M": LlamaFileType.MOSTLY_Q3_K_M,
                      "Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M, "Q5_K_M": LlamaFileType.MOSTLY_Q5_K_M,
                      "Q6_K": LlamaFileType.MOSTLY_Q6_K}


@dataclass
class Written:
    """What went into the file: tensors per GGUF type; Q4_1 offsets in all, and how many were rounded."""

    types: dict[str, int] = field(default_factory=dict)
    offsets: int = 0
    rounded_offsets: int = 0


# ---- blocks: pure functions on tensors ---------------------------------------------------------------------------

def _half_bytes(x: torch.Tensor) -> np.ndarray:
    """float16 bytes of x [N, B] -> [N, B, 2] uint8"""
    return x.to(torch.float16).contiguous().numpy().view(np.uint8).reshape(*x.shape, 2)


def q8_0_blocks(codes: torch.Tensor, d: torch.Tensor) -> np.ndarray:
    """int8 codes [N, K] and block scales d [N, K/32] -> Q8_0 bytes [N, K/32 * 34]"""
    N, K = codes.shape
    qs = codes.to(torch.int8).contiguous().numpy().view(np.uint8).reshape(N, K // BLOCK, BLOCK)
    return np.concatenate([_half_bytes(d), qs], axis=-1).reshape(N, -1)


def q4_blocks(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> np.ndarray:
    """4-bit codes [N, K] in [0, 15], block scales d and offsets m [N, K/32] -> Q4_1 bytes [N, K/32 * 20]; Q4_0
    bytes [N, K/32 * 18] when m is None. Byte j of a block holds code j (low nibble) and code j + 16 (high)."""
    N, K = codes.shape
    q = codes.to(torch.uint8).reshape(N, K // BLOCK, 2, BLOCK // 2)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).contiguous().numpy()
    return np.concatenate([_half_bytes(d), *([] if m is None else [_half_bytes(m)]), qs], axis=-1).reshape(N, -1)


def per_block(x: torch.Tensor, K: int) -> torch.Tensor:
    """Per-row or per-group values [N, G] (G divides K/32) repeated for every 32-weight block -> [N, K/32]"""
    return x.repeat_interleave(K // BLOCK // x.shape[1], dim=1)


def encode_layer(m: torch.nn.Module, name: str, round_offsets: bool = False) -> tuple[Q, np.ndarray, int, int]:
    """One quantized Linear -> (GGUF type, blocks [N, bytes per row], Q4_1 offsets, offsets rounded to float16),
    checked to dequantize to exactly the weight leanlm computes with (with rounded offsets, where allowed)."""
    if not isinstance(m, (W8A16Linear, W8A16Sparse24Linear, W4A16Linear)):
        why = {"w8a8": "its float32 row scales with int8 activations", "llm_int8": "its 16-bit outlier columns",
               "fp8": "float8 weights", "aqlm": "additive codebooks"}.get(m.SCHEME, "this scheme")
        raise LeanLMError(f"{name} is {m.SCHEME}: GGUF has no type for {why}; GGUF export takes w8a16 (Q8_0) and "
                          "w4a16 (Q4_1) layers, e.g. from `leanlm quantize --bits 8` or `--bits 4`")
    K = m.in_features
    if K % BLOCK:
        raise LeanLMError(f"{name}: in_features={K} is not a multiple of 32, the length of a GGUF block")
    ours = m.dequantized_weight().float()
    if isinstance(m, (W8A16Linear, W8A16Sparse24Linear)):
        codes = m.codes() if isinstance(m, W8A16Sparse24Linear) else m.weight
        blocks = q8_0_blocks(codes, per_block(m.scales.float()[:, None], K))
        _check(blocks, Q.Q8_0, ours, f"{name}: a row scale that float16 (Q8_0's block scale) cannot hold exactly")
        return Q.Q8_0, blocks, 0, 0
    s, Z = m.scales.float().t(), m.zeros.float().t()  # [N, K/g]
    codes = unpack_int4(m.weight_packed)
    if not Z.any():
        blocks = q4_blocks(codes, per_block(s, K), None)
        _check(blocks, Q.Q4_0, ours, f"{name}: a group scale that float16 (Q4_0's block scale) cannot hold exactly")
        return Q.Q4_0, blocks, 0, 0
    offset = Z - 8 * s  # exact in float32: two bf16 values within 2^4 of each other
    rounded = int((offset.half().float() != offset).sum())
    blocks = q4_blocks(codes, per_block(s, K), per_block(offset, K))
    if rounded and round_offsets:  # the weights llama.cpp will compute with: our codes and scales, offsets rounded
        ours = codes.float() * per_block(s, K).repeat_interleave(BLOCK, 1) \
            + per_block(offset.half().float(), K).repeat_interleave(BLOCK, 1)
    elif rounded:
        raise LeanLMError(f"{name}: {rounded} of its {offset.numel()} int4 groups have an offset (Q4_1's m = -z s) "
                          "that float16 cannot hold exactly (it needs 12 significant bits), so Q4_1 would change "
                          "their weights by well under 1% of a quantization step; pass --round-offsets to accept that")
    _check(blocks, Q.Q4_1, ours, f"{name}: a group scale that float16 (Q4_1's block scale) cannot hold exactly")
    return Q.Q4_1, blocks, offset.numel(), rounded


def _check(blocks: np.ndarray, qtype: Q, ours: torch.Tensor, problem: str) -> None:
    """Refuse blocks that do not dequantize to `ours` [N, K] bit for bit."""
    back = torch.from_numpy(np.asarray(dequantize(blocks, qtype), dtype=np.float32)).reshape(ours.shape)
    if not torch.equal(back, ours):
        raise LeanLMError(f"{problem}; GGUF export keeps the weights bit for bit or refuses")


# ---- tensors -----------------------------------------------------------------------------------------------------

def _dense_type(t: torch.Tensor) -> Q:
    return Q.F32 if t.dim() == 1 else Q.BF16 if t.dtype == torch.bfloat16 else Q.F16


def _array(t: torch.Tensor, qtype: Q) -> np.ndarray:
    """What GGUFWriter takes: float arrays, or raw bytes [N, bytes per row] with the type given."""
    if qtype == Q.F32:
        return t.float().contiguous().numpy()
    if qtype == Q.F16:
        return t.to(torch.float16).contiguous().numpy()
    if qtype == Q.BF16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint8)
    return t.contiguous().numpy()  # blocks already


def gguf_tensors(model, round_offsets: bool = False, mixture: str | None = None,
                 imatrix: dict[str, torch.Tensor] | None = None,
                 progress=None) -> tuple[dict[str, tuple[Q, np.ndarray]], Written]:
    """GGUF name -> (type, array) for every weight of `model`, Llama's Q/K rows permuted for llama.cpp; with a
    k-quant `mixture`, every float weight matrix quantized to its type in that mixture (with `imatrix`, GGUF name ->
    the mean squared input of each column, where it has one). progress() is called after each tensor."""
    cfg = model.config
    layers = quantized_layers(model)
    if mixture and layers:
        raise LeanLMError(f"a k-quant GGUF ({mixture}) is made from a float model's weights; this model has "
                          f"{len(layers)} layers quantized by leanlm already (export it without --type)")
    groups: dict[Q, dict[str, torch.Tensor]] = {}  # type -> {our name: rows}: to_hf_names splits fused rows
    for name, t in model.state_dict().items():
        owner = next((n for n in layers if name.startswith(n + ".")), None)
        skip = (owner and not name.endswith(".bias")) or name.startswith("rope_")
        if not skip and not (name == "lm_head.weight" and model.lm_head_is_embedding):
            groups.setdefault(_dense_type(t), {})[name] = t
    written = Written()
    for name, m in layers.items():
        qtype, blocks, offsets, rounded = encode_layer(m, name, round_offsets)
        groups.setdefault(qtype, {})[f"{name}.weight"] = torch.from_numpy(blocks)
        written.offsets += offsets
        written.rounded_offsets += rounded
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
    out = {}
    for stored, tensors in groups.items():
        for hf, t in to_hf_names(tensors, cfg).items():
            name = gguf_name(hf)
            if ARCH[cfg.model_type] == "llama" and name.split(".")[-2] in heads:
                t = permute_rotary(t, heads[name.split(".")[-2]])
            if mixture and stored in (Q.BF16, Q.F16):  # a float weight matrix
                qtype = kquants.tensor_type(mixture, name, t.shape[1], cfg.num_layers,
                                            cfg.num_heads // cfg.num_kv_heads, model.lm_head_is_embedding)
                weights = (imatrix or {}).get(name)
                if weights is not None and weights.shape != (t.shape[1],):
                    raise LeanLMError(f"the importance matrix has {weights.numel()} values for {name}, which has "
                                      f"{t.shape[1]} inputs: it was made for another model")
                blocks, back = kquants.quantize(t, qtype, weights)
                _check(blocks, qtype, back, f"{name}: {qtype.name} blocks that do not dequantize as computed")
                out[name] = (qtype, blocks)
            else:
                qtype = stored
                out[name] = (qtype, _array(t, qtype))
            written.types[qtype.name] = written.types.get(qtype.name, 0) + 1
            if progress:
                progress()
    return out, written


@torch.no_grad()
def importance_matrix(model, samples: torch.Tensor, batch_size: int = 2, progress=None) -> dict[str, torch.Tensor]:
    """llama-imatrix's importance matrix from calibration windows `samples` [n, T]: for each weight matrix (GGUF
    name), the mean over every token of the square of each input column  # -> {name: [K] float32}.
    The output projection's inputs are counted under token_embd.weight when the two share weights."""
    cfg = model.config
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    sums = {name: torch.zeros(m.in_features, dtype=torch.float64) for name, m in linears.items()}

    def hook(name):
        def add(module, args, output):
            sums[name] += args[0].reshape(-1, args[0].shape[-1]).double().square().sum(0)
        return add

    hooks = [m.register_forward_hook(hook(name)) for name, m in linears.items()]
    try:
        n, T = samples.shape
        positions = torch.arange(T)[None]
        for i in range(0, n, batch_size):
            batch = samples[i:i + batch_size].to(model.device)
            model(batch, positions.expand(batch.shape[0], T).to(model.device))
            if progress:
                progress(batch.shape[0])
    finally:
        for h in hooks:
            h.remove()
    tied = model.lm_head_is_embedding
    matrix = {}
    for name, m in linears.items():
        mean = (sums[name] / samples.numel()).float()
        for hf in to_hf_names({f"{name}.weight": m.weight}, cfg):
            matrix["token_embd.weight" if tied and hf == "lm_head.weight" else gguf_name(hf)] = mean
    return matrix


def read_imatrix(path: Path) -> dict[str, torch.Tensor]:
    """The importance matrix in a GGUF file that llama-imatrix wrote: for each weight, its `NAME.in_sum2` (the sum
    of each input's square) over `NAME.counts` (the tokens seen)  # -> {GGUF name: [K] float32}"""
    from leanlm.models.gguf import open_gguf

    reader = open_gguf(path)
    kind = reader.fields.get("general.type")
    if kind is None or bytes(kind.parts[-1]).decode() != "imatrix":
        raise LeanLMError(f"{path}: not an importance matrix written by llama-imatrix (general.type is not "
                          "'imatrix'; its older .dat format is not read)")
    tensors = {t.name: torch.from_numpy(np.array(t.data, dtype=np.float32)) for t in reader.tensors}
    return {name.removesuffix(".in_sum2"): sums / tensors[name.removesuffix("in_sum2") + "counts"].clamp_min(1)
            for name, sums in tensors.items() if name.endswith(".in_sum2")}


# ---- tokenizer ---------------------------------------------------------------------------------------------------

# tokenizer.json Split regexes of byte-level BPE tokenizers (Qwen2; Llama 3 groups digits by up to three)
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
                r"\s+(?!\S)|\s+")
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


def llama_cpp_pre(pre: dict | None) -> str:
    """The llama.cpp pre-tokenizer (tokenizer.ggml.pre) that splits text as this tokenizer.json pre_tokenizer does."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"  # GPT-2's split regex, which ByteLevel applies itself
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"  # each digit alone, then GPT-2's regex
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        regex = steps[0].get("pattern", {}).get("Regex")
        named = {_QWEN2_SPLIT: "qwen2", _LLAMA3_SPLIT: "llama-bpe"}.get(regex)
        if named:
            return named
    raise LeanLMError(f"the tokenizer's pre-tokenizer ({' + '.join(map(str, kinds)) or 'none'}) is not one whose "
                      "llama.cpp counterpart leanlm knows (byte-level BPE as in GPT-2, SmolLM, Qwen2, Llama 3)")


def tokenizer_metadata(source: Path, vocab_size: int) -> dict:
    """The tokenizer.ggml.* keys for the byte-level BPE tokenizer of a model directory, its vocabulary padded to
    the embedding's `vocab_size` rows."""
    data = json.loads((Path(source) / "tokenizer.json").read_text())
    model = data.get("model", {})
    if model.get("type") != "BPE" or (data.get("decoder") or {}).get("type") != "ByteLevel":
        raise LeanLMError(f"{source}: GGUF export writes byte-level BPE tokenizers (GPT-2, SmolLM, Qwen2, Llama 3); "
                          f"this one is {model.get('type')} with a {(data.get('decoder') or {}).get('type')} decoder")
    pre = llama_cpp_pre(data.get("pre_tokenizer"))
    tok = Tokenizer(source)
    vocab = tok._tok.get_vocab(with_added_tokens=True)
    if max(vocab.values()) >= vocab_size:
        raise LeanLMError(f"{source}: the tokenizer has ids up to {max(vocab.values())}, past the embedding's "
                          f"{vocab_size} rows")
    added = {t["id"]: t for t in data.get("added_tokens", [])}
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]  # ids no token uses, as llama.cpp's converter names them
    types = [TokenType.UNUSED] * vocab_size
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = (TokenType.NORMAL if i not in added else
                    TokenType.CONTROL if added[i].get("special") else TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    plain, special = tok.encode("a", add_special_tokens=False), tok.encode("a")
    bos = tok.token_id(tok.bos_token) if tok.bos_token else None
    meta = {"model": "gpt2", "pre": pre, "tokens": tokens, "types": types, "merges": merges,
            "add_bos": len(special) > len(plain) and special[0] == bos and special[1:] == plain[: len(special) - 1],
            "add_eos": len(special) > len(plain) and special[-1] == tok.eos_token_id,
            "bos": bos, "eos": tok.eos_token_id, "chat_template": tok.chat_template}
    config = json.loads((Path(source) / "tokenizer_config.json").read_text()) \
        if (Path(source) / "tokenizer_config.json").exists() else {}
    pad = config.get("pad_token")
    pad = pad.get("content") if isinstance(pad, dict) else pad
    meta["pad"] = tok.token_id(pad) if pad else None
    meta["unk"] = tok.token_id(model["unk_token"]) if model.get("unk_token") else None
    return meta


# ---- the file ----------------------------------------------------------------------------------------------------

def export_gguf(model, source: Path, out: Path, round_offsets: bool = False, mixture: str | None = None,
                imatrix: dict[str, torch.Tensor] | None = None, progress=None) -> Written:
    """Write `model` (loaded from the directory `source`, whose tokenizer it takes) to the GGUF file `out`, atomically
    (a failed export leaves nothing); with a k-quant `mixture` (and `imatrix`), see gguf_tensors."""
    cfg = model.config
    cfg.check_portable("GGUF (llama.cpp)")
    vocab = tokenizer_metadata(source, cfg.vocab_size)  # first: a tokenizer we cannot write fails before any work
    tensors, written = gguf_tensors(model, round_offsets, mixture, imatrix, progress)
    weights = [q for name, (q, _) in tensors.items() if name.endswith(".weight") and q != Q.F32]
    file_type = MIXTURE_FILE_TYPES[mixture] if mixture else \
        FILE_TYPES.get(max(set(weights), key=weights.count), LlamaFileType.ALL_F32)
    partial = Path(out).with_name(Path(out).name + ".partial")
    writer = GGUFWriter(partial, ARCH[cfg.model_type])
    try:
        writer.add_name(Path(source).name)
        writer.add_context_length(cfg.max_position)
        writer.add_embedding_length(cfg.hidden_size)
        writer.add_feed_forward_length(cfg.intermediate_size)
        writer.add_block_count(cfg.num_layers)
        writer.add_head_count(cfg.num_heads)
        writer.add_head_count_kv(cfg.num_kv_heads)
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_rope_dimension_count(cfg.head_dim)
        writer.add_rope_freq_base(cfg.rope_theta)
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_file_type(file_type)
        writer.add_quantization_version(GGML_QUANT_VERSION)
        writer.add_tokenizer_model(vocab["model"])
        writer.add_tokenizer_pre(vocab["pre"])
        writer.add_token_list(vocab["tokens"])
        writer.add_token_types(vocab["types"])
        writer.add_token_merges(vocab["merges"])
        for key in ("bos", "eos", "pad", "unk"):
            if vocab[key] is not None:
                getattr(writer, f"add_{key}_token_id")(vocab[key])
        writer.add_add_bos_token(vocab["add_bos"])
        writer.add_add_eos_token(vocab["add_eos"])
        if vocab["chat_template"]:
            writer.add_chat_template(vocab["chat_template"])
        for name, (qtype, array) in tensors.items():
            writer.add_tensor(name, array, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, out)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    return written
