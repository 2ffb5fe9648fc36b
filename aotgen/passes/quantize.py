"""Weight-only quantization as a graph pass on the ExportedProgram.

The pass finds `aten.linear` / `aten.embedding` nodes whose weight is a lifted parameter or
constant, swaps in the quantized kernel with new constants, and drops the float weight
from the program so the package never stores it. It works on the exported graph, not on
`nn.Module`s, so it needs no knowledge of the model definition and leaves every graph's
inputs, outputs and KV-cache contract as they were: the runtime runs the result unchanged.

The options are parsed in passes/quantize_options.py, the weights quantized and the kernels
described in passes/quantize_numerics.py. The kernels are 10-30x slower with float32
activations than with bfloat16 ones, so by default the pass casts the activation to
bfloat16 just around each quantized op: norms, attention, residuals, KV cache and logits
stay float32, and the cast fuses into the neighbouring kernels (a whole-bf16 graph,
`dtype: bfloat16`, decoded within noise of it).

The pass is called once per graph (prefill, decode, verify); it caches the quantized
tensors by source tensor so all graphs share the same tensor objects and the builder
stores each quantized weight once.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.export import ExportedProgram
from torch.fx import Node

from aotgen.kernels import block_dot
from aotgen.passes.fx import WeightEditor, compact_names, op_name, view_dims
from aotgen.passes.fx import emit as emit_node
from aotgen.passes.gptq import gptq_codes, input_hessians
from aotgen.passes.quantize_numerics import (
    int4_in_features,
    int8_in_features,
    kernel_problem,
    pack_int4,
    pad_in_features,
    quantize_int4,
    quantize_int8,
    register_int4_lowering,
)
from aotgen.passes.quantize_options import QuantizeOptions, Scheme, parse_quantize
from aotgen.recipe import RecipeError

aten = torch.ops.aten

# `emit(replaced, target, *args, **kwargs)`: a node with `replaced`'s metadata (passes/fx.py).
Emit = Callable[..., Node]


@dataclass
class _Quantized:
    """The constants that replace one source weight, shared by every graph."""

    tensors: dict[str, Tensor]  # suffix -> tensor
    scheme: Scheme
    nbytes: int


@dataclass(frozen=True, eq=False)
class _Site:
    """One op the pass rewrites: its weight, and the kernel layout chosen for it."""

    name: str  # the op's module path, as reports and patterns name it
    target: str  # the weight's name in the program
    source: Tensor  # the float weight
    scheme: Scheme
    in_features: int  # the weight's, zero-padded to what the kernel takes
    linear: bool  # else an embedding
    blocks: bool  # the int8-activation block kernels

    @property
    def device(self) -> str:
        return self.source.device.type


class QuantizePass:
    """`ExportedProgram -> ExportedProgram`; one instance per model, reused for its graphs."""

    def __init__(self, options: QuantizeOptions, device: str = "cpu"):
        self.options = options
        self.device = device
        # int8 activations are quantized inside the block kernels, which take float32.
        self.blocks = options.activations == "int8"
        self.act_dtype = torch.float32 if self.blocks else getattr(torch, options.activations)
        if self.blocks and device != "cpu":
            raise RecipeError(
                f"quantize.activations: int8 runs AVX2/portable CPU kernels; on {device} use "
                "bfloat16 (the default) or float32"
            )
        if not self.blocks:  # the block kernels are compiled into the package: nothing to probe
            self._probe_kernels()
        self._cache: dict[tuple, _Quantized] = {}
        self._keep: list[Tensor] = []  # sources stay alive so their ids stay unique
        # id(source weight) -> (the weight, kept alive, and GPTQ's X^T X of its input)
        self._hessians: dict[int, tuple[Tensor, Tensor]] = {}
        self.calibration_tokens = 0
        self.quantized: dict[str, str] = {}  # op name -> scheme label
        self.skipped: dict[str, str] = {}  # op name -> reason
        self.padded: dict[str, tuple[int, int]] = {}  # op name -> (in_features, padded)
        self.seen: set[str] = set()  # names skip patterns were tried on
        self.float_bytes = 0
        self.quant_bytes = 0

    def _probe_kernels(self) -> None:
        """Fail at recipe time, naming the scheme, if a kernel does not run here; a graph
        that compiles but crashes in the runtime would be found much later."""
        options, device = self.options, self.device
        schemes = [("linear", options.linear), ("embedding", options.embedding)]
        schemes += [(f"overrides.{p}", s) for p, s in options.overrides]
        for where, scheme in schemes:
            if scheme is None:
                continue
            problem = kernel_problem(scheme.kind, device, options.activations)
            if problem:
                where_run = torch.backends.cpu.get_cpu_capability() if device == "cpu" else device
                raise RecipeError(
                    f"quantize.{where}: the {scheme.kind} kernel does not run on this "
                    f"platform ({where_run}, torch {torch.__version__}): {problem}. Use "
                    "another scheme or drop `quantize`"
                )
            if scheme.kind == "int4" and device == "cpu":
                register_int4_lowering()

    @property
    def needs_calibration(self) -> bool:
        return self.options.method == "gptq"

    def calibrate(self, ep: ExportedProgram, batches: list[tuple], tokens: int) -> None:
        """GPTQ: record the input Hessian of every linear in `ep` run on `batches` (its user
        inputs: `tokens` calibration tokens in all). Call it once, before the first graph,
        on a graph that holds the same weight tensors as the graphs to quantize."""
        weights = {**ep.state_dict, **ep.constants}
        for name, hessian in input_hessians(ep, batches).items():
            self._hessians[id(weights[name])] = (weights[name], hessian)
        self.calibration_tokens = tokens

    # -- bookkeeping used by the builder -----------------------------------------------------
    @property
    def _packable(self) -> bool:
        """Weight-only CPU kernels that compile.packed_linears moves onto float32 panels
        (passes/pack.py: int8 per channel, int4 groups of a multiple of 32)."""
        return self.device == "cpu" and not self.blocks

    @property
    def _int8_on_gpu(self) -> bool:
        """CUDA int8 linears, which the build rewrites to float32 Inductor kernels
        (passes/gemv.py `int8_linears_for_gpu`)."""
        lin = self.options.linear
        return self.device == "cuda" and not self.blocks and lin is not None and lin.kind == "int8"

    def notes(self) -> list[str]:
        """Human-readable build-report lines: what was quantized, skipped, and warnings."""
        o = self.options
        notes = []
        by_scheme: dict[str, int] = {}
        for label in self.quantized.values():
            by_scheme[label] = by_scheme.get(label, 0) + 1
        if by_scheme:
            summary = ", ".join(f"{n} x {label}" for label, n in sorted(by_scheme.items()))
            notes.append(
                f"quantize: {summary}; weights {self.float_bytes / 2**20:.1f} MiB float -> "
                f"{self.quant_bytes / 2**20:.1f} MiB, kernels compute in {o.activations}"
                + (" (float32 where packed into panels)" if self._packable else "")
                + (" (int8 linears in float32: passes/gemv.py)" if self._int8_on_gpu else "")
            )
        if self.needs_calibration:
            notes.append(
                f"quantize: linears rounded by GPTQ on {self.calibration_tokens} tokens of "
                f"{o.calibration.name}"
            )
        reasons: dict[str, set[str]] = {}
        for name, reason in self.skipped.items():
            reasons.setdefault(reason, set()).add(name)
        for reason, names in sorted(reasons.items()):
            notes.append(f"quantize: kept in float ({reason}): {compact_names(names)}")
        paddings: dict[tuple[int, int], set[str]] = {}
        for name, sizes in self.padded.items():
            paddings.setdefault(sizes, set()).add(name)
        for (k, padded), names in sorted(paddings.items()):
            notes.append(
                f"quantize: in_features zero-padded {k} -> {padded} for the kernel "
                f"(+{padded / k - 1:.0%} weight bytes): {compact_names(names)}"
            )
        for pattern in (*o.skip, *(p for p, _ in o.overrides)):
            if not any(fnmatch.fnmatchcase(n, pattern) for n in self.seen):
                notes.append(
                    f"warning: quantize pattern {pattern!r} matched no linear or embedding; "
                    "patterns are globs on module paths like 'lm_head' or "
                    "'model.layers.*.mlp.down_proj' (or on weight names)"
                )
        return notes

    def note_module_weights(self, outcomes: dict[str, str | None], label: str) -> None:
        """Weights quantized on the module before export (`label`; None outcome) or kept float
        by a skip pattern (the pattern): reported, recorded and matched against the recipe's
        patterns as the graph's linears are."""
        self.seen.update(outcomes)
        for name, pattern in outcomes.items():
            if pattern is None:
                self.quantized[name] = label
            else:
                self.skipped[name] = f"skip pattern {pattern!r}"

    def manifest_entry(self) -> dict[str, Any]:
        """What the manifest records: schemes, dtypes, and which ops stayed float."""

        def describe(
            s: Scheme | None, kernel: str, blocks: bool, activations: str
        ) -> dict[str, Any] | None:
            if s is None:
                return None
            return {
                "scheme": s.kind,
                "groupsize": block_dot.BLOCK if blocks else s.groupsize,
                "symmetric": s.kind == "int8",
                "granularity": "per-channel" if s.kind == "int8" and not blocks else "per-group",
                "weight_dtype": "int8" if s.kind == "int8" else "uint4 (packed)",
                "scale_dtype": "float16" if blocks else str(self.act_dtype).removeprefix("torch."),
                "activation_dtype": activations,
                "kernel": kernel,
            }

        o, lin = self.options, self.options.linear
        if self.blocks:
            kind = lin.kind if lin else "int8"
            lin_kernel = (
                f"aotgen.{kind}_block_linear (kernels/block_dot.cpp; with "
                "compile.packed_linears, gguf_dot's panels where the autotune measured faster)"
            )
        elif self._int8_on_gpu:
            lin_kernel = "float32 Triton reduction / dequantized matmul (passes/gemv.py)"
        elif lin and lin.kind == "int8":
            lin_kernel = "aten._weight_int8pack_mm"
        elif self.device == "cpu":
            lin_kernel = "quantized.int4mm_packed_weight_cpu (aten._weight_int4pack_mm_for_cpu)"
        else:
            lin_kernel = "aten._weight_int4pack_mm (tinygemm)"
        return {
            "linear": describe(
                lin, lin_kernel, self.blocks, "float32" if self._int8_on_gpu else o.activations
            ),
            "embedding": describe(self.options.embedding, "gather + scale", False, o.activations),
            "method": self.options.method,
            "calibration": (
                {"text": self.options.calibration.name, "tokens": self.calibration_tokens}
                if self.needs_calibration
                else None
            ),
            "skip": list(self.options.skip),
            "overrides": {p: s.label for p, s in self.options.overrides},
            "quantized": dict(sorted(self.quantized.items())),
            "kept_float": dict(sorted(self.skipped.items())),
            "padded_in_features": {n: list(s) for n, s in sorted(self.padded.items())},
        }

    # -- the pass ----------------------------------------------------------------------------
    def __call__(self, ep: ExportedProgram) -> ExportedProgram:
        edit = WeightEditor(ep)
        # (activation, width) -> its 2-D, kernel-dtype version, zero-padded to the width
        inputs: dict[tuple[Node, int], Node] = {}
        emit = partial(emit_node, edit.graph)
        for node in list(edit.graph.nodes):
            site = self._site(node, edit)
            if site is not None:
                self._rewrite(node, site, edit, emit, inputs)
        return edit.finish()

    def _site(self, node: Node, edit: WeightEditor) -> _Site | None:
        """What to make of `node`: None leaves it as it is (`skipped` says why, where a
        recipe's author would want to know)."""
        if node.op != "call_function":
            return None
        linear = node.target is aten.linear.default
        if linear:
            weight, scheme = node.args[1], self.options.linear
        elif node.target is aten.embedding.default and self.options.embedding:
            weight, scheme = node.args[0], self.options.embedding
        else:
            return None
        lifted = edit.weight(weight)
        if lifted is None:
            return None  # computed weight: not ours to quantize
        target, source = lifted
        name = op_name(node, target)
        scheme = self._scheme_for(name, target, scheme, linear)
        if scheme is None:
            return None
        blocks = self.blocks and linear
        in_features = self._kernel_in_features(name, source, scheme, linear, blocks)
        if in_features is None:
            return None
        return _Site(name, target, source, scheme, in_features, linear, blocks)

    def _scheme_for(
        self, name: str, target: str, default: Scheme | None, linear: bool
    ) -> Scheme | None:
        """A skip pattern keeps the op float; else a linear takes its first matching
        override, and anything else the default scheme."""
        self.seen.update((name, target))
        names = (name, target)
        pattern = next((p for p in self.options.skip if _matches(p, names)), None)
        if pattern is not None:
            self.skipped[name] = f"skip pattern {pattern!r}"
            return None
        if linear:
            return next((s for p, s in self.options.overrides if _matches(p, names)), default)
        return default

    def _kernel_in_features(
        self, name: str, source: Tensor, scheme: Scheme, linear: bool, blocks: bool
    ) -> int | None:
        """The in_features the kernel takes for `source` (zero-padded), or None where no
        kernel takes it."""
        device = source.device.type
        in_features = source.shape[-1]
        if blocks:
            in_features = block_dot.in_features(in_features, 4 if scheme.kind == "int4" else 8)
            if in_features > block_dot.MAX_IN_FEATURES:
                self.skipped[name] = f"block kernels take <= {block_dot.MAX_IN_FEATURES} inputs"
                return None
        elif scheme.kind == "int4":
            in_features, problem = int4_in_features(*source.shape, scheme.groupsize, device)
            if problem:
                self.skipped[name] = f"int4: {problem}"
                return None
        elif linear:  # an embedding row is never padded
            in_features = int8_in_features(in_features, device)
        if in_features != source.shape[-1]:
            self.padded[name] = (source.shape[-1], in_features)
        return in_features

    def _rewrite(
        self,
        node: Node,
        site: _Site,
        edit: WeightEditor,
        emit: Emit,
        inputs: dict[tuple[Node, int], Node],
    ) -> None:
        """Replace `node` by the quantized kernel reading new constants."""
        hessian = self._hessian(site.source) if site.linear else None
        q = self._quantize(
            site.source, site.scheme, site.device, hessian, site.in_features, site.blocks
        )
        # A tied weight can be GPTQ-rounded as lm_head and rounded to nearest as the
        # embedding: two tensors, two names.
        prefix = f"{site.target}_gptq" if hessian is not None else site.target
        nodes = {sfx: edit.add(f"{prefix}_{sfx}", t) for sfx, t in q.tensors.items()}
        if site.scheme.kind == "int4" and not site.blocks:
            g = site.scheme.groupsize
            nodes["groupsize"] = edit.add(f"int4_groupsize_{g}", self._groupsize(g))
        with edit.graph.inserting_before(node):
            if site.linear:
                out = self._linear(node, nodes, site, emit, inputs)
            else:
                out = self._embedding(node, nodes, emit)
        node.replace_all_uses_with(out)
        edit.graph.erase_node(node)
        self.quantized[site.name] = site.scheme.label

    def _hessian(self, source: Tensor) -> Tensor | None:
        """GPTQ's input Hessian of this weight, if `calibrate` saw it."""
        entry = self._hessians.get(id(source))
        return entry[1] if entry else None

    def _groupsize(self, g: int) -> Tensor:
        # One tensor object per group size (shared by all graphs); [1], not 0-d, so that
        # Inductor inlines it as a tiny computed buffer instead of a bound constant.
        key = ("groupsize", g)
        if key not in self._cache:
            self._cache[key] = _Quantized({"g": torch.tensor([g])}, Scheme("int4", g), 0)
        return self._cache[key].tensors["g"]

    # -- the constants -----------------------------------------------------------------------
    def _quantize(
        self,
        source: Tensor,
        scheme: Scheme,
        device: str,
        hessian: Tensor | None,
        in_features: int,
        blocks: bool = False,
    ) -> _Quantized:
        """Quantize once per (source tensor, scheme, layout, GPTQ or not): every graph gets
        the same objects. GPTQ runs when the linear's input Hessian is given. `blocks`: the
        layouts of the block kernels (a tied embedding keeps its per-row int8)."""
        key = (id(source), scheme, self.options.activations, hessian is not None, blocks)
        if key not in self._cache:
            self._keep.append(source)
            w, hessian = pad_in_features(source, hessian, in_features)
            tensors = self._kernel_tensors(w, hessian, scheme, device, blocks)
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            self._cache[key] = _Quantized(tensors, scheme, nbytes)
            if not any(t is source for t in self._keep[:-1]):  # a tied weight counts once
                self.float_bytes += source.numel() * source.element_size()
            self.quant_bytes += nbytes
        return self._cache[key]

    def _kernel_tensors(
        self, w: Tensor, hessian: Tensor | None, scheme: Scheme, device: str, blocks: bool
    ) -> dict[str, Tensor]:
        """The constants the kernel reads for the (padded) weight `w`, by name suffix."""
        act = self.act_dtype
        if blocks:
            int4 = scheme.kind == "int4"
            q, s = (block_dot.quantize_int4 if int4 else block_dot.quantize_int8)(w)
            return {f"{scheme.kind}b32": q, f"{scheme.kind}b32_scales": s}
        if scheme.kind == "int8":
            q, s = quantize_int8(w, act)
            if hessian is not None:
                scale = s.float()[:, None].expand_as(q)
                zero = torch.zeros_like(scale)
                q = gptq_codes(w, hessian, scale, zero, -128, 127).to(torch.int8)
            return {"int8": q, "int8_scales": s}
        g = scheme.groupsize
        importance = None if hessian is None else torch.diagonal(hessian)
        q, sz = quantize_int4(w, g, act, importance=importance)
        if hessian is not None:
            scale, zero = sz.float().transpose(0, 1).repeat_interleave(g, dim=1).unbind(-1)
            q = gptq_codes(w, hessian, scale, zero, 0, 15, offset=8)
        sfx = f"int4g{g}"
        return {sfx: pack_int4(q, device), f"{sfx}_scales_zeros": sz.to(device)}

    # -- the replacement ops -----------------------------------------------------------------
    def _linear(
        self,
        node: Node,
        consts: dict[str, Node],
        site: _Site,
        emit: Emit,
        inputs: dict[tuple[Node, int], Node],
    ) -> Node:
        """view to 2-D, cast, pad -> kernel -> cast back, view, bias."""
        x, _w, *rest = node.args
        bias = rest[0] if rest else None
        out_val = node.meta["val"]
        out_shape = self._out_shape(node, emit)
        h = self._kernel_input(node, x, site.in_features, emit, inputs)
        h = self._kernel_call(node, h, consts, site, emit)
        if out_val.dtype != self.act_dtype:
            h = emit(node, aten._to_copy.default, h, dtype=out_val.dtype)
        h = emit(node, aten.view.default, h, out_shape)
        if bias is not None:
            h = emit(node, aten.add.Tensor, h, bias)
        return h

    def _out_shape(self, node: Node, emit: Emit) -> list[Any]:
        """The linear's output shape for a view of the kernel's 2-D result."""
        x = node.args[0]
        lead = list(x.meta["val"].shape[:-1])
        n = node.meta["val"].shape[-1]
        # The kernels take 2-D activations; a single dynamic dim (the token count) is -1.
        if sum(not isinstance(d, int) for d in lead) <= 1:
            return [*view_dims(lead), n]
        return [
            d if isinstance(d, int) else emit(node, aten.sym_size.int, x, i)
            for i, d in enumerate(lead)
        ] + [n]

    def _kernel_input(
        self,
        node: Node,
        x: Node,
        in_features: int,
        emit: Emit,
        inputs: dict[tuple[Node, int], Node],
    ) -> Node:
        """`x` as the kernel takes it: 2-D, in the kernel's dtype, zero-padded to the
        weight's in_features. q/k/v (and gate/up) read the same activation: each form is
        made once per graph, not once per op."""
        x_val = x.meta["val"]
        k = x_val.shape[-1]
        if (x, k) not in inputs:
            h = emit(node, aten.view.default, x, [-1, k])
            if x_val.dtype != self.act_dtype:
                h = emit(node, aten._to_copy.default, h, dtype=self.act_dtype)
            inputs[(x, k)] = h
        if (x, in_features) not in inputs:  # zero columns for the weight's padding
            pad = [0, in_features - k]
            inputs[(x, in_features)] = emit(node, aten.constant_pad_nd.default, inputs[(x, k)], pad)
        return inputs[(x, in_features)]

    def _kernel_call(
        self, node: Node, h: Node, consts: dict[str, Node], site: _Site, emit: Emit
    ) -> Node:
        """The quantized matmul of the 2-D input `h` for the site's scheme and device."""
        scheme = site.scheme
        if site.blocks:
            sfx = f"{scheme.kind}b32"
            return emit(
                node, block_dot.OP_FOR[scheme.kind], h, consts[sfx], consts[f"{sfx}_scales"]
            )
        if scheme.kind == "int8":
            # CPU and CUDA (AOTI has a C shim for both).
            return emit(
                node, aten._weight_int8pack_mm.default, h, consts["int8"], consts["int8_scales"]
            )
        sfx = f"int4g{scheme.groupsize}"
        if site.device == "cpu":
            # The same kernel as `aten._weight_int4pack_mm_for_cpu`, whose Inductor lowering
            # would add the group size as an anonymous runtime constant the package cannot
            # bind; this op takes it as a (small, inlined) tensor. See
            # `quantize_numerics.register_int4_lowering`.
            return emit(
                node,
                torch.ops.quantized.int4mm_packed_weight_cpu.default,
                h,
                consts[sfx],
                consts["groupsize"],
                consts[f"{sfx}_scales_zeros"],
            )
        # tinygemm on CUDA
        return emit(
            node,
            aten._weight_int4pack_mm.default,
            h,
            consts[sfx],
            scheme.groupsize,
            consts[f"{sfx}_scales_zeros"],
        )

    def _embedding(self, node: Node, consts: dict[str, Node], emit: Emit) -> Node:
        """Gather int8 rows and their scales, dequantize in the output dtype."""
        ids = node.args[1]
        dtype = node.meta["val"].dtype
        rows = emit(node, aten.embedding.default, consts["int8"], ids)
        scales = emit(node, aten.index.Tensor, consts["int8_scales"], [ids])
        rows = emit(node, aten._to_copy.default, rows, dtype=dtype)
        scales = emit(node, aten._to_copy.default, scales, dtype=dtype)
        return emit(node, aten.mul.Tensor, rows, emit(node, aten.unsqueeze.default, scales, -1))


def _matches(pattern: str, names: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(n, pattern) for n in names)


def quantize_pass(raw: dict[str, Any] | None, device: str = "cpu") -> QuantizePass | None:
    """Recipe `quantize:` → the pass (None when the recipe does not quantize)."""
    options = parse_quantize(raw)
    return QuantizePass(options, device) if options and not options.gguf else None


def quantize_passes(raw: dict[str, Any] | None, device: str = "cpu") -> list[QuantizePass]:
    """The builder's hook: the graph passes a `quantize:` mapping asks for."""
    qp = quantize_pass(raw, device)
    return [qp] if qp else []
