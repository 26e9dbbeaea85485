"""THE layer-by-layer calibration loop, shared by GPTQ, AWQ, SmoothQuant, LLM.int8() and pruning (and `reconstruct`
below, the block-output loop of AutoRound and AQLM).

    x = embed(samples)                                  # the first block's inputs  [n, T, d]
    for each block i:
        hook every Linear of the block; run the block on x in mini-batches -> stats of each Linear's input
        remove the hooks; solve(i, block, {name: (linear, stats)})   # may edit weights or replace modules
        x = block(x)                                    # re-run the *modified* block: the next inputs

Re-running the block after `solve` means block i+1 calibrates on the activations of the already
compressed blocks 0..i (as GPTQ and SparseGPT do), so errors made early are seen and compensated later.

Cost: one forward pass to collect stats plus one to feed forward, per block (about two model forwards
in all). Memory: one activation buffer of n x T x d in the model's dtype (the outputs of a mini-batch
overwrite its own inputs, so inputs and outputs are never both alive in full), plus one mini-batch's
intermediates and the stats of one block. At the usual 128 x 512 samples (DEFAULT_N_SAMPLES x
DEFAULT_SEQ_LEN in leanlm.eval.datasets) and d = 576 (SmolLM2-135M) in bfloat16 that is 75 MB.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from leanlm.lowbit.record import replace
from leanlm.models.layers import Linear

DEFAULT_BATCH_SIZE = 8  # samples per forward; bounds the attention/MLP intermediates, not the stats


@torch.no_grad()  # not inference_mode: tensors `solve` creates must stay usable by autograd later (distillation)
def calibrate(model: nn.Module, samples: torch.Tensor,
              solve: Callable[[int, nn.Module, dict[str, tuple[Linear, object]]], None],
              make_stats: Callable[[Linear], object], batch_size: int = DEFAULT_BATCH_SIZE,
              progress: Callable[[str], None] | None = None, sequential: bool = False) -> dict:
    """Calibrate `model` (a Transformer) block by block on `samples` [n, T] token ids.

    make_stats(linear) -> an accumulator with `add_batch(x)`; it receives each Linear's inputs as float32
        rows [batch * T, in_features] (the activations themselves stay in the model's dtype).
    solve(block_index, block, {name: (linear, stats)}) runs after the stats of a block are complete; names
        are relative to the model ("layers.3.self_attn.qkv_proj"). It may change weights in place or
        replace modules (lowbit.record.replace); the block is then re-run to produce the next block's inputs.
    progress(name) is called with "layers.{i}" after each block.
    sequential: solve the block's Linears one at a time in forward order (qkv, o, gate_up, down), each on
        inputs that come through the already-solved ones ("true sequential" in the GPTQ reference code);
        costs one block forward per Linear instead of one per block.
    Every sample is a full causal window at positions 0..T-1, with no KV cache.
    Returns {"blocks": number of blocks, "tokens": n * T}.
    """
    n, T = samples.shape
    device, dtype = model.device, model.dtype
    cos, sin = model.rope(torch.arange(T, device=device)[None])  # [1, T, 1, D], broadcast over the batch
    x = torch.empty(n, T, model.config.hidden_size, dtype=dtype, device=device)
    batches = [slice(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]
    for b in batches:
        x[b] = model.embed_tokens(samples[b].to(device))

    def run(block: nn.Module, write: bool) -> None:
        for b in batches:
            y = block(x[b], cos, sin, None, None, T > 1)
            if write:
                x[b] = y  # this mini-batch's inputs are no longer needed

    for i, block in enumerate(model.layers):
        prefix = f"layers.{i}"
        linears = {f"{prefix}.{name}": m for name, m in block.named_modules() if isinstance(m, Linear)}
        for group in [[name] for name in linears] if sequential else [list(linears)]:
            stats = input_stats({name: linears[name] for name in group}, make_stats, lambda: run(block, write=False))
            solve(i, block, {name: (linears[name], stats[name]) for name in group})
            del stats  # the stats are the solver's to keep or drop
        run(model.layers[i], write=True)  # solve may have replaced the block's modules, not the block
        if progress is not None:
            progress(prefix)
    return {"blocks": len(model.layers), "tokens": n * T}


def input_stats(linears: dict[str, Linear], make_stats: Callable[[Linear], object], forward: Callable[[], object]
                ) -> dict[str, object]:
    """Each Linear's make_stats(linear) accumulator, fed the Linear's inputs while forward() runs (hooks removed
    after, even on failure)."""
    stats = {name: make_stats(linear) for name, linear in linears.items()}
    hooks = [linear.register_forward_hook(_feeder(stats[name])) for name, linear in linears.items()]
    try:
        forward()
    finally:
        for h in hooks:
            h.remove()
    return stats


def _feeder(stats) -> Callable:
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        inp = args[0]
        stats.add_batch(inp.reshape(-1, inp.shape[-1]).float())

    return hook


# step(block_index, block, {name: Linear}, inputs, targets, rope, run) -> {name: the packed module for that Linear}
BlockStep = Callable[[int, nn.Module, dict, torch.Tensor, torch.Tensor, tuple, Callable], dict]


def reconstruct(model: nn.Module, samples: torch.Tensor, step: BlockStep,
                progress: Callable[[str], None] | None = None) -> dict[str, dict]:
    """The block-by-block loop of the methods that tune a block on its output (AutoRound, AQLM): for each block the
    targets are the float block's outputs on the float model's inputs; `step` fits the block's projections on the
    quantized model's inputs (the outputs of the blocks already quantized) and returns their packed modules, which
    replace them; the block is then run again to give the next one its quantized-model inputs. run(block, x) is the
    block's forward over all windows in mini-batches. Returns each packed layer's record; progress(name) after each.
    Memory: three activation buffers of n x T x d."""
    n, T = samples.shape
    device = model.device
    rope = model.rope(torch.arange(T, device=device)[None])
    batches = [slice(i, min(i + DEFAULT_BATCH_SIZE, n)) for i in range(0, n, DEFAULT_BATCH_SIZE)]

    def run(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([block(x[b], *rope, None, None, T > 1) for b in batches])

    with torch.no_grad():
        x_float = torch.cat([model.embed_tokens(samples[b].to(device)) for b in batches])
    x_quant, records = x_float, {}
    for i, block in enumerate(model.layers):
        target = run(block, x_float)
        linears = {name: m for name, m in block.named_modules() if isinstance(m, Linear)}
        for name, new in step(i, block, linears, x_quant, target, rope, run).items():
            replace(block, name, new)
            records[f"layers.{i}.{name}"] = new.record()
            if progress:
                progress(f"layers.{i}.{name}")
        x_float, x_quant = target, run(block, x_quant)
    return records


def fit_block(block: nn.Module, params: list[torch.Tensor], inputs: torch.Tensor, targets: torch.Tensor, rope: tuple,
              iters: int, batch_size: int, generator: torch.Generator,
              update: Callable[[int, tuple[torch.Tensor, ...]], None]) -> float:
    """`iters` steps fitting block(inputs) to targets [n, T, d] by mean squared error on random mini-batches of
    `batch_size` windows: update(step, gradients of params) moves the parameters (under no_grad). The parameters of
    the lowest loss seen are left in place. Returns the loss of the last step."""
    best, best_loss, loss = [p.detach().clone() for p in params], float("inf"), float("nan")
    n, T = inputs.shape[:2]
    for step in range(iters):
        pick = torch.randperm(n, generator=generator)[:batch_size]
        mse = F.mse_loss(block(inputs[pick], *rope, None, None, T > 1).float(), targets[pick].float())
        loss = mse.item()
        if loss < best_loss:  # the parameters that gave this loss are those before the step below
            best_loss = loss
            for b, p in zip(best, params):
                b.copy_(p)
        grads = torch.autograd.grad(mse, params)
        with torch.no_grad():
            update(step, grads)
    with torch.no_grad():
        for b, p in zip(best, params):
            p.copy_(b)
    return loss
