"""A decode step compiled with torch.compile (inductor): static shapes, fused kernels, little Python per step.

Eager PyTorch pays a fixed cost per op; a 30-layer model runs ~600 ops per token, which on a small model
costs as much as reading its weights. Compiled, every layer becomes a few fused C++ loops. Shapes must
stay fixed, so the compiled step writes the new key/value at a slot given as a tensor and attends over
every slot of the cache with a mask, instead of slicing to the current length.
"""

from __future__ import annotations

import types

import torch

from leanlm import kernels
from leanlm.cache.base import UpdateThenAttend
from leanlm.cache.static import StaticCache
from leanlm.cache.int8 import dequantize_per_token, quantize_per_token
from leanlm.lowbit.hadamard import OnlineRotation
from leanlm.models.transformer import Transformer


# cpp_wrapper: a C++ launcher, no Python between kernels.
# realize_opcount_threshold: inductor inlines a pointwise chain into its consumer unless the chain has more
# ops than this (CPU default 50). Inlined into a GEMV, the RMSNorm and residual before each projection are
# recomputed for every one of its output rows, which made the kernels compute-bound. At batch 1 those
# activations are a single row, so storing them costs nothing. Measured on the default model, bf16, two
# threads (tokens/s): default 60, threshold 16: 70, 12: 73, 10: 82, 9: 83, 8: 90, 7: 77, 4: 65, 2: 75.
# size_asserts off: the launcher would check the sizes and strides of each of its ~250-490 inputs (the weights
# among them) on every step, ~0.2 ms on the default model; the model is fixed once compiled (see CompiledDecoder).
# cpp_wrapper_build_separate: g++ builds the kernels at -O3 and the launcher (~3800 straight lines for 30 layers) at
# -O1, apart: a graph of the default model compiled in 68-92 s instead of 104-148 s, its steps as fast (29.5 / 36.5 /
# 121 ms at 1 / 8 / 32 rows against 29.2 / 36.4 / 121; Zen 3, alternating in one process, 15 runs each).
INDUCTOR_OPTIONS = {"cpu": {"cpp_wrapper": True, "realize_opcount_threshold": 8, "size_asserts": False,
                            "cpp_wrapper_build_separate": True}, "cuda": {}}


class _SlotCache(UpdateThenAttend):
    """KVCache for one static-shape step: writes at a tensor slot, attends over every slot (masked). With scales
    (an Int8KVCache's), k and v are stored as int8 codes with a scale per (token, head) and read dequantized."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], slot: torch.Tensor, mask: torch.Tensor,
                 k_scale: list[torch.Tensor] | None = None, v_scale: list[torch.Tensor] | None = None):
        self.k, self.v, self.slot, self.mask, self.k_scale, self.v_scale = k, v, slot, mask, k_scale, v_scale

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self.k_scale is None:
            self.k[layer].index_copy_(2, self.slot, k)
            self.v[layer].index_copy_(2, self.slot, v)
            return self.k[layer], self.v[layer]
        out = []
        for codes, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, scale = quantize_per_token(x)
            codes[layer].index_copy_(2, self.slot, q)
            scales[layer].index_copy_(2, self.slot, scale)
            # float32, not rounded back to x.dtype: with two more conversions the chain feeding attention's
            # reductions passes realize_opcount_threshold, and inductor stored its [B, Hkv, G, S, D] products
            # (two 9 MB buffers per layer at 4096 slots: 8x slower than the bf16 cache)
            out.append(dequantize_per_token(codes[layer], scales[layer], torch.float32))
        return tuple(out)

    def attention_mask(self, T: int):
        return self.mask, False

    def advance(self, T: int) -> None:
        pass


def _step(model: Transformer, tokens, k, v, slot, pad, k_scale, v_scale):
    """tokens [B]; slot [1]; pad [B] -> logits [B, V]"""
    tokens, positions = tokens[:, None], (slot - pad)[:, None]
    key = torch.arange(k[0].shape[2], device=tokens.device)
    mask = (key[None] <= slot) & (key[None] >= pad[:, None])  # [B, S]
    cache = _SlotCache(k, v, slot, mask[:, None, None, :], k_scale, v_scale)
    return model(tokens, positions, cache, last_only=True)[:, -1]


class StepCompiler:
    """Runs `fn(model, **inputs)` compiled: each new key (the inputs' shapes and kinds) goes once through
    torch.compile; later calls run the compiled graph directly, with its inputs in the order the compiler recorded.
    Dynamo's per-call work (its frame hook and guards on ~500 inputs) cost ~0.6 ms per token on the default model, a
    tenth of a W4A16 step; the model is fixed, so nothing those guards check can change."""

    def __init__(self, model: torch.nn.Module, fn, cuda_graphs: bool = True):
        """`model` must not change (weights, dtype, modules) once compiled. cuda_graphs: on a GPU, replay each
        step as a CUDA graph (see _GraphedPlan)."""
        self.model, self.step, self.cuda_graphs = model, fn, cuda_graphs
        # timed now, eagerly: the traced Linears read them; so do online rotations their matrices
        kernels.bf16_rows(), kernels.int8_rows(), kernels.w8a16_rows()
        device = next(model.parameters()).device
        for m in model.modules():
            if isinstance(m, OnlineRotation):
                m.factors(device)
        self._plans: dict[tuple, _Plan | None] = {}
        self._compiled: dict[tuple, object] = {}  # key -> its own torch.compile'd copy of fn
        self._captured: tuple | None = None

    def _compile(self, batch: tuple[int, int] | None = None):
        options = dict(INDUCTOR_OPTIONS[next(self.model.parameters()).device.type])
        if batch is not None:
            options["post_grad_custom_post_pass"] = _range_key(batch)

        def backend(gm, example_inputs):
            from torch._inductor import compile as inductor_compile  # heavy (~1.5 s): only a compile needs it

            compiled = inductor_compile(gm, example_inputs, options)
            sources = [getattr(n.meta.get("grapharg"), "source", None) for n in gm.graph.find_nodes(op="placeholder")]
            self._captured = compiled, list(example_inputs), sources
            return compiled

        # Dynamo keeps its graphs per code object: a copy of the step's code per key compiles (and captures) each
        # graph once, never as a recompile of another (Dynamo stops a code object after 8), and two models of equal
        # shapes never run each other's.
        step = types.FunctionType(self.step.__code__.replace(), self.step.__globals__, self.step.__name__)
        return torch.compile(step, fullgraph=True, dynamic=False, backend=backend)

    def __call__(self, key: tuple, inputs: dict, batch: tuple[int, int] | None = None) -> torch.Tensor:
        """inputs: fn's parameters by name (Dynamo takes them as keywords, a plan fills its input list from them).
        batch (first, last): the key's graph takes any batch size in that range, the first dimension of every
        tensor input (not those in lists) symbolic; None: every shape as this call's."""
        if key in self._plans:
            plan = self._plans[key]
            return plan.run(inputs) if plan is not None else self._compiled[key](self.model, **inputs)
        self._captured = None
        if batch is not None:
            for value in inputs.values():
                if isinstance(value, torch.Tensor):
                    torch._dynamo.mark_dynamic(value, 0, min=batch[0], max=batch[1])
        self._compiled[key] = self._compile(batch)
        out = self._compiled[key](self.model, **inputs)
        captured, self._captured = self._captured, None  # the graph's example inputs hold this call's tensors
        plan = _Plan.make(*captured, inputs, self.model) if captured is not None else None
        if plan is not None and self.cuda_graphs and next(self.model.parameters()).is_cuda:
            plan = _GraphedPlan(plan)
        self._plans[key] = plan
        return out


def _range_key(batch: tuple[int, int]):
    """A post-grad pass that changes nothing, whose uuid keys inductor's caches by a graph's batch range: a graph
    of the same code cached for another range would otherwise be a hit whose recorded bounds contradict this range
    (torch raises ConstraintViolationError)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class RangeKey(CustomGraphPass):
        def __call__(self, graph) -> None:
            pass

        def uuid(self) -> tuple:
            return ("leanlm batch range", *batch)

    return RangeKey()


class CompiledDecoder:
    """decode_step() with the same contract as generation.decode.decode_step, run by a compiled graph (one per
    batch size, cache length and cache kind)."""

    def __init__(self, model: Transformer, cuda_graphs: bool = True):
        """`model` must not change (weights, dtype, modules) once its decoder is built."""
        self.model = model
        self.compiler = StepCompiler(model, _step, cuda_graphs)

    @torch.inference_mode()
    def decode_step(self, cache: StaticCache, tokens: torch.Tensor) -> torch.Tensor:
        B, dev = tokens.shape[0], tokens.device
        pad = cache.pad if cache.pad is not None else torch.zeros(B, dtype=torch.long, device=dev)
        slot = torch.tensor([cache.length], device=dev)
        scales = getattr(cache, "k_scale", None), getattr(cache, "v_scale", None)  # an Int8KVCache's
        inputs = dict(tokens=tokens, k=cache.k, v=cache.v, slot=slot, pad=pad, k_scale=scales[0], v_scale=scales[1])
        key = (tuple(cache.k[0].shape), cache.k[0].dtype, scales[0] is not None, tokens.dtype)
        logits = self.compiler(key, inputs)
        cache.advance(1)
        return logits


class _Plan:
    """A compiled graph and where each of its inputs comes from: a fixed tensor of the model, one of the step's
    inputs (a tensor, or element j of a list such as the cache's k), or a symbolic size (dimension d of a tensor
    input)."""

    def __init__(self, fn, template: list, slots: list[tuple[int, str, int | None, int | None]]):
        self.fn, self.template, self.slots = fn, template, slots

    @staticmethod
    def make(fn, example_inputs: list, sources: list, inputs: dict, model: torch.nn.Module) -> _Plan | None:
        """None where an input is neither a step input, a size of one, nor a parameter or buffer of the model
        (Dynamo stays). sources: Dynamo's source of each graph input (where a symbolic size was read)."""
        from torch._dynamo.source import LocalSource, TensorProperty, TensorPropertySource

        where = {}
        for name, value in inputs.items():
            if isinstance(value, torch.Tensor):
                where[id(value)] = name, None, None
            elif isinstance(value, (list, tuple)):  # other values (ints) are constants of the graph
                where.update((id(t), (name, j, None)) for j, t in enumerate(value))
        for x, source in zip(example_inputs, sources):
            if isinstance(x, torch.SymInt) and isinstance(source, TensorPropertySource) \
                    and source.prop == TensorProperty.SIZE and isinstance(source.base, LocalSource) \
                    and isinstance(inputs.get(source.base.local_name), torch.Tensor):
                where[id(x)] = source.base.local_name, None, source.idx
        fixed = {id(t) for t in (*model.parameters(), *model.buffers())}
        if not all(id(x) in where or id(x) in fixed for x in example_inputs):
            return None
        slots = [(n, *where[id(x)]) for n, x in enumerate(example_inputs) if id(x) in where]
        template = [None if id(x) in where else x for x in example_inputs]  # the model's tensors stay
        return _Plan(fn, template, slots)

    def run(self, inputs: dict) -> torch.Tensor:
        args = self.template.copy()
        for n, name, j, dim in self.slots:
            args[n] = inputs[name].shape[dim] if dim is not None else inputs[name] if j is None else inputs[name][j]
        (logits,) = self.fn(*args)
        return logits


class _GraphedPlan:
    """A plan replayed as a CUDA graph. A compiled step still launches each of its kernels from Python, one after
    another: on an H200 the compiled step of smollm2-135m took 3.2 ms (eager: 14 ms) where reading its weights takes
    0.07 ms, so small models wait for the launches, not the memory. A graph launches them all at once. It holds the
    addresses it was captured with: the list inputs (the cache's k and v) key it, and a new cache captures it again;
    the single tensors (tokens, slot, pad) are copied into its own buffers."""

    def __init__(self, plan: _Plan):
        self.plan, self.key, self.graph, self.buffers, self.out = plan, None, None, {}, None

    def run(self, inputs: dict) -> torch.Tensor:
        key = tuple(t.data_ptr() for v in inputs.values() if isinstance(v, (list, tuple)) for t in v)
        if key != self.key:
            self._capture(inputs)
            self.key = key
        for name, buffer in self.buffers.items():
            buffer.copy_(inputs[name])
        self.graph.replay()
        return self.out.clone()

    def _capture(self, inputs: dict) -> None:
        self.graph = self.out = None  # the last cache's graph and its memory go first
        self.buffers = {name: v.clone() for name, v in inputs.items() if isinstance(v, torch.Tensor)}
        fixed = {**inputs, **self.buffers}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # a warm-up off the capture (it writes this step's k and v, as the replay will)
            self.plan.run(fixed)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.plan.run(fixed)
