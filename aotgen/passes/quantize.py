"""Weight-only quantization as a graph pass on the ExportedProgram.

    quantize: {linear: int8}                                   # per-channel symmetric
    quantize: {linear: {int4: {groupsize: 64}}, embedding: int8, skip: [lm_head]}

The pass finds `aten.linear` / `aten.embedding` nodes whose weight is a lifted parameter or
constant, swaps in the quantized kernel with new constants, and drops the float weight
from the program so the package never stores it. It works on the exported graph, not on
`nn.Module`s, so it needs no knowledge of the model definition and leaves every graph's
inputs, outputs and KV-cache contract as they were: the runtime runs the result unchanged.

Kernels (CPU):
- int8: `aten._weight_int8pack_mm(x[M, K], w_int8[N, K], scales[N])`, w ≈ w_int8 * scale.
- int4: the kernel of `aten._weight_int4pack_mm_for_cpu(x, packed, groupsize, scales_zeros)`
  with w ≈ (q - 8) * scale + zero per group of `groupsize` inputs, q in 0..15, packed by
  `aten._convert_weight_to_int4pack_for_cpu`, scales_zeros [K / groupsize, N, 2]. The graph
  calls it as `quantized.int4mm_packed_weight_cpu` (see `_register_int4_lowering`).
Both are 10-30x slower with float32 activations than with bfloat16 ones (measured on a
2-vCPU AVX-512 AMD EPYC), and take scales in the activation dtype, so by default the pass casts
the activation to bfloat16 just around each quantized op: norms, attention, residuals,
KV cache and logits stay float32, and the cast fuses into the neighbouring kernels (a
whole-bf16 graph, `dtype: bfloat16`, decoded within noise of it). Scales are rounded to
that dtype *before* the weights are quantized against them, so the kernel sees exactly
the scales the integers were chosen for.

`activations: int8` (CPU): int4 (g32) / int8 weights against activations quantized per row and
block of 32 as the op runs, integer dot products (`aotgen/kernels/block_dot.py`, C++ compiled into
the package). Lossy in the activations: meant for speculative drafts.

CUDA (a recipe with `device: cuda`; `_weight_int8pack_mm`, `_weight_int4pack_mm` with
tinygemm packing): written to the ops' contracts and probed on the GPU at build time;
tests/test_cuda.py checks them where a GPU is present (docs/cuda.md).

`method: gptq` picks the integers with GPTQ (passes/gptq.py) instead of rounding to nearest:
the builder first runs `calibrate` on a prefill graph over calibration text, which records
each linear's input Hessian; the kernels and the package format are the same.

Skip patterns are shell globs (`fnmatch`, case-sensitive), matched against the module path
of the op (`lm_head`, `model.layers.0.mlp.down_proj`, `model.embed_tokens`) and against
the weight's parameter name (`...down_proj.weight`). Globs, not regexes, because module
paths are full of dots that a regex would treat as wildcards.

The pass is called once per graph (prefill, decode, verify); it caches the quantized
tensors by source tensor so all graphs share the same tensor objects and the builder
stores each quantized weight once.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.export import ExportedProgram
from torch.fx import Node

from aotgen.kernels import block_dot
from aotgen.passes.fx import WeightEditor, compact_names, op_name
from aotgen.passes.fx import emit as emit_node
from aotgen.passes.gptq import gptq_codes, input_hessians
from aotgen.recipe import RecipeError

aten = torch.ops.aten

SCHEMES = ("int8", "int4")
EMBEDDING_SCHEMES = ("int8",)
GROUP_SIZES = (32, 64, 128, 256)
DEFAULT_GROUPSIZE = 64
ACTIVATION_DTYPES = ("bfloat16", "float32", "int8")
METHODS = ("rtn", "gptq")
OPTION_KEYS = ("linear", "embedding", "skip", "overrides", "activations", "method", "calibration")
CALIBRATION_TEXT = Path(__file__).resolve().parents[1] / "data" / "calibration.txt"
CUDA_INNER_K_TILES = 8


# ---- options -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scheme:
    kind: str  # "int8" | "int4"
    groupsize: int | None = None  # int4 only

    @property
    def label(self) -> str:
        return self.kind if self.groupsize is None else f"{self.kind}-g{self.groupsize}"


@dataclass(frozen=True)
class QuantizeOptions:
    linear: Scheme | None = None
    embedding: Scheme | None = None
    skip: tuple[str, ...] = ()
    overrides: tuple[tuple[str, Scheme], ...] = ()  # (glob, scheme) for matching linears
    activations: str = "bfloat16"  # dtype the quantized kernels compute in
    method: str = "rtn"  # "rtn": round to nearest; "gptq": see passes/gptq.py
    calibration: Path = CALIBRATION_TEXT  # text GPTQ runs the model on


def _scheme(where: str, value: Any) -> Scheme:
    """`int8` | `int4` | `{int4: {groupsize: 64}}` | `{int8: {}}`."""
    if isinstance(value, str):
        kind, params = value, {}
    elif isinstance(value, dict) and len(value) == 1:
        kind, params = next(iter(value.items()))
        params = params or {}
    else:
        raise RecipeError(
            f"quantize.{where}: expected a scheme name ({', '.join(SCHEMES)}) or "
            f"{{int4: {{groupsize: N}}}}, got {value!r}"
        )
    if kind not in SCHEMES:
        raise RecipeError(f"quantize.{where}: unknown scheme {kind!r}; valid: {', '.join(SCHEMES)}")
    if not isinstance(params, dict):
        raise RecipeError(f"quantize.{where}.{kind}: expected a mapping, got {params!r}")
    valid = ["groupsize"] if kind == "int4" else []
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise RecipeError(
            f"quantize.{where}.{kind}: unknown key(s) {', '.join(unknown)}; "
            f"valid keys: {', '.join(valid) or '(none)'}"
        )
    if kind == "int8":
        return Scheme("int8")
    g = params.get("groupsize", DEFAULT_GROUPSIZE)
    if g not in GROUP_SIZES:
        raise RecipeError(
            f"quantize.{where}.int4: groupsize {g!r} is not supported by the int4 kernels; "
            f"valid: {', '.join(map(str, GROUP_SIZES))}"
        )
    return Scheme("int4", g)


def parse_quantize(raw: dict[str, Any] | None) -> QuantizeOptions | None:
    """Validate a recipe's `quantize:` mapping; errors say what to write instead."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RecipeError(f"quantize: expected a mapping like {{linear: int8}}, got {raw!r}")
    unknown = sorted(set(raw) - set(OPTION_KEYS))
    if unknown:
        raise RecipeError(
            f"quantize: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(OPTION_KEYS)}"
        )
    linear = _scheme("linear", raw["linear"]) if raw.get("linear") is not None else None
    embedding = None
    if raw.get("embedding") is not None:
        embedding = _scheme("embedding", raw["embedding"])
        if embedding.kind not in EMBEDDING_SCHEMES:
            raise RecipeError(
                f"quantize.embedding: {embedding.kind} is not supported for embeddings; "
                f"valid: {', '.join(EMBEDDING_SCHEMES)}"
            )
    overrides = raw.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise RecipeError(
            f"quantize.overrides: expected {{glob: scheme}} like {{lm_head: int8}}, got "
            f"{overrides!r}"
        )
    override_schemes = tuple((str(p), _scheme(f"overrides.{p}", v)) for p, v in overrides.items())
    if linear is None and embedding is None and not override_schemes:
        raise RecipeError("quantize: nothing to do; set `linear:` and/or `embedding:`")
    skip = raw.get("skip") or []
    if isinstance(skip, str):
        skip = [skip]
    if not isinstance(skip, list) or not all(isinstance(p, str) and p for p in skip):
        raise RecipeError(f"quantize.skip: expected a list of glob patterns, got {skip!r}")
    act = raw.get("activations", "bfloat16")
    if act not in ACTIVATION_DTYPES:
        raise RecipeError(f"quantize.activations: {act!r}; valid: {', '.join(ACTIVATION_DTYPES)}")
    method = raw.get("method", "rtn")
    if method not in METHODS:
        raise RecipeError(f"quantize.method: {method!r}; valid: {', '.join(METHODS)}")
    if act == "int8":
        overridden = [(f"overrides.{p}", s) for p, s in override_schemes]
        _check_block_schemes([("linear", linear), *overridden])
        if method != "rtn":
            raise RecipeError(
                "quantize.method: gptq is not implemented for `activations: int8`; "
                "drop `method` (round to nearest)"
            )
    calibration = Path(raw.get("calibration") or CALIBRATION_TEXT)
    if "calibration" in raw and method != "gptq":
        raise RecipeError("quantize.calibration: only `method: gptq` reads calibration text")
    if not calibration.is_file():
        raise RecipeError(
            f"quantize.calibration: {calibration} is not a file; give a plain-text file "
            "(relative paths resolve against the recipe's directory)"
        )
    return QuantizeOptions(
        linear, embedding, tuple(skip), override_schemes, act, method, calibration
    )


def _check_block_schemes(schemes: list[tuple[str, Scheme | None]]) -> None:
    """`activations: int8` runs the block kernels (kernels/block_dot.py): blocks of 32."""
    for where, scheme in schemes:
        if scheme is not None and scheme.kind == "int4" and scheme.groupsize != block_dot.BLOCK:
            raise RecipeError(
                f"quantize.{where}: int4 with `activations: int8` quantizes in blocks of "
                f"{block_dot.BLOCK}; write {{int4: {{groupsize: {block_dot.BLOCK}}}}}"
            )


# ---- quantize / dequantize (plain tensors) ---------------------------------------------------
def quantize_int8(w: Tensor, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Per-output-channel symmetric: w[n] ≈ q[n] * scale[n], q int8 [N, K], scale [N]."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(scale_dtype)
    q = (w / scale.float()[:, None]).round().clamp(-128, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    return q.float() * scale.float()[:, None]


def quantize_int4(
    w: Tensor,
    groupsize: int,
    scale_dtype: torch.dtype,
    search: bool = True,
    importance: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Group-wise asymmetric: w ≈ (q - 8) * scale + zero per `groupsize` inputs, q in 0..15.

    Starts from each group's min/max; with `search`, also tries clipped ranges and refines
    each by alternating rounding with a least-squares fit of (scale, zero), keeping per
    group whichever has the lowest squared error (min/max is a candidate: never worse).
    Searching cuts the g64 weight error ~14 % on SmolLM2 (whose weights were 4-bit
    already); it costs ~1 s per layer there, min/max alone ~0.05 s.
    `importance` [K] weights each input column's error (llama.cpp's imatrix; GPTQ passes
    the mean squared input of each column), so the 16 levels go where inputs are large.
    Returns q int32 [N, K] and scales_zeros [K / groupsize, N, 2] (the kernels' layout).
    """
    n, k = w.shape
    wg = w.detach().float().reshape(n, k // groupsize, groupsize)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    if importance is None:
        importance = torch.ones(k, device=w.device)
    imp = importance.detach().float().clamp(min=0)
    imp = (imp + 1e-12).reshape(1, k // groupsize, groupsize)

    def fit(scale: Tensor, zero: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        s = scale.clamp(min=1e-12).to(scale_dtype).float()
        z = zero.to(scale_dtype).float()
        q = ((wg - z[..., None]) / s[..., None] + 8).round().clamp(0, 15)
        err = (imp * ((q - 8) * s[..., None] + z[..., None] - wg).pow(2)).sum(dim=-1)
        return q, s, z, err

    def weighted_mean(x: Tensor) -> Tensor:
        return (imp * x).sum(dim=-1) / imp.sum(dim=-1)

    best = fit((hi - lo) / 15, lo + 8 * (hi - lo) / 15)  # q = 0 lands on the group minimum
    for shrink in (1.0, 0.9) if search else ():
        mid, half = (lo + hi) / 2, (hi - lo) / 2 * shrink
        cand = fit(half / 7.5, mid - half + 8 * half / 7.5)
        for _ in range(2):
            c = cand[0] - 8
            c_mean, w_mean = weighted_mean(c), weighted_mean(wg)
            var = weighted_mean((c - c_mean[..., None]).pow(2))
            cov = weighted_mean((c - c_mean[..., None]) * (wg - w_mean[..., None]))
            scale = torch.where(var > 0, cov / var.clamp(min=1e-12), cand[1])
            cand = fit(scale, w_mean - scale * c_mean)
        better = cand[3] < best[3]
        best = tuple(
            torch.where(better[..., None] if c.dim() == 3 else better, c, b)
            for c, b in zip(cand, best, strict=True)
        )
    q, scale, zero, _ = best
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return q.to(torch.int32).reshape(n, k), scales_zeros.to(scale_dtype)


def dequantize_int4(q: Tensor, scales_zeros: Tensor, groupsize: int) -> Tensor:
    n, k = q.shape
    sz = scales_zeros.float().transpose(0, 1)  # [N, K/g, 2]
    qg = q.float().reshape(n, k // groupsize, groupsize)
    return ((qg - 8) * sz[..., :1] + sz[..., 1:]).reshape(n, k)


def pack_int4(q: Tensor, device: str) -> Tensor:
    """The kernel's weight layout. CPU: uint8 [N, K/2]. CUDA: tinygemm tiles (gpt-fast's
    packing, two codes per byte, high nibble first)."""
    if device == "cpu":
        return aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 2)
    q8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).to(device)
    return aten._convert_weight_to_int4pack(q8, CUDA_INNER_K_TILES)


def int4_in_features(n: int, k: int, groupsize: int, device: str) -> tuple[int, str | None]:
    """The in_features the int4 kernel takes for an [N, K] weight, or why it cannot take it.

    K is zero-padded up to a multiple of the group size (and on CUDA of tinygemm's K tile,
    128): the pass pads the activation with zeros to match, so the padded columns add
    nothing. SmolLM2's hidden size 576 becomes 640 for g128 or on CUDA.
    """
    if device != "cpu" and n % 8:
        return k, f"CUDA tinygemm needs out_features % 8 == 0, got {n}"
    multiple = groupsize if device == "cpu" else max(groupsize, CUDA_INNER_K_TILES * 16)
    return -(-k // multiple) * multiple, None


def int8_in_features(k: int, device: str) -> int:
    """The in_features the int8 kernel takes: on CPU a multiple of 8, since ATen's AVX2
    `_weight_int8pack_mm` reads past rows of other lengths (wrong results or a crash,
    torch 2.13). Padded like int4's."""
    return -(-k // 8) * 8 if device == "cpu" else k


def pad_in_features(
    w: Tensor, hessian: Tensor | None, in_features: int
) -> tuple[Tensor, Tensor | None]:
    """`w` with zero columns up to `in_features`, and GPTQ's input Hessian with an identity
    block for them (inputs that are always zero; the identity keeps it invertible)."""
    pad = in_features - w.shape[-1]
    if not pad:
        return w, hessian
    w = torch.nn.functional.pad(w.detach(), (0, pad))
    if hessian is not None:
        padded = torch.eye(in_features, dtype=hessian.dtype, device=hessian.device)
        padded[:-pad, :-pad] = hessian
        hessian = padded
    return w, hessian


@cache
def kernel_problem(kind: str, device: str, act: str) -> str | None:
    """Run the kernel once on a tiny weight on `device`: None if it works, else the error."""
    dtype = getattr(torch, act)
    w = torch.randn(64, 128)  # K = 128: one CUDA tinygemm tile
    x = torch.randn(2, 128, dtype=dtype, device=device)
    try:
        if kind == "int8":
            q, s = quantize_int8(w, dtype)
            aten._weight_int8pack_mm(x, q.to(device), s.to(device))
        else:
            q, sz = quantize_int4(w, 32, dtype)
            if device == "cpu":
                g = torch.tensor([32])
                torch.ops.quantized.int4mm_packed_weight_cpu(x, pack_int4(q, "cpu"), g, sz)
            else:
                aten._weight_int4pack_mm(x, pack_int4(q, device), 32, sz.to(device))
    except (RuntimeError, NotImplementedError) as e:
        return str(e).splitlines()[0]
    return None


@cache
def _register_int4_lowering() -> None:
    """Lower `quantized.int4mm_packed_weight_cpu` to the extern kernel Inductor itself uses
    for `aten._weight_int4pack_mm_for_cpu` (C shim `aoti_torch_cpu__weight_int4pack_mm_cpu_tensor`).

    Inductor's own lowering of the aten op makes the group size an anonymous constant
    (`constantN`) that a package with weights outside the .so has no value for; without a
    lowering, this op would go through AOTI's slow proxy executor. Inductor internals:
    torch is pinned, and tests/test_quantize.py compiles an int4 graph to catch a change.
    Only the non-autotuned kernel: max_autotune's C++ int4 micro-GEMM is not used.
    """
    from torch._inductor import ir
    from torch._inductor.lowering import register_lowering
    from torch._inductor.mkldnn_ir import WeightInt4PackMatmul

    op = torch.ops.quantized.int4mm_packed_weight_cpu

    @register_lowering(op, type_promotion_kind=None)
    def _lower(x: Any, w: Any, groupsize: Any, scales_zeros: Any) -> Any:
        args = [
            ir.ExternKernel.require_contiguous(ir.ExternKernel.realize_input(t))
            for t in (x, w, groupsize, scales_zeros)
        ]
        return ir.TensorBox.create(WeightInt4PackMatmul.create(*args))


# ---- the graph pass --------------------------------------------------------------------------
@dataclass
class _Quantized:
    """The constants that replace one source weight, shared by every graph."""

    tensors: dict[str, Tensor]  # suffix -> tensor
    scheme: Scheme
    nbytes: int


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
        schemes = [("linear", options.linear), ("embedding", options.embedding)]
        schemes += [(f"overrides.{p}", s) for p, s in options.overrides]
        for where, scheme in schemes:
            if scheme is None or self.blocks:
                continue  # the block kernels are compiled into the package: nothing to probe
            problem = kernel_problem(scheme.kind, device, options.activations)
            if problem:
                where_run = torch.backends.cpu.get_cpu_capability() if device == "cpu" else device
                raise RecipeError(
                    f"quantize.{where}: the {scheme.kind} kernel does not run on this "
                    f"platform ({where_run}, torch {torch.__version__}): {problem}. Use "
                    "another scheme or drop `quantize`"
                )
            if scheme.kind == "int4" and device == "cpu":
                _register_int4_lowering()
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

    def manifest_entry(self) -> dict[str, Any]:
        """What the manifest records: schemes, dtypes, and which ops stayed float."""

        def describe(s: Scheme | None, kernel: str, blocks: bool) -> dict[str, Any] | None:
            if s is None:
                return None
            return {
                "scheme": s.kind,
                "groupsize": block_dot.BLOCK if blocks else s.groupsize,
                "symmetric": s.kind == "int8",
                "granularity": "per-channel" if s.kind == "int8" and not blocks else "per-group",
                "weight_dtype": "int8" if s.kind == "int8" else "uint4 (packed)",
                "scale_dtype": "float16" if blocks else str(self.act_dtype).removeprefix("torch."),
                "activation_dtype": self.options.activations,
                "kernel": kernel,
            }

        lin = self.options.linear
        if self.blocks:
            kind = lin.kind if lin else "int8"
            lin_kernel = f"aotgen.{kind}_block_linear (kernels/block_dot.cpp)"
        elif lin and lin.kind == "int8":
            lin_kernel = "aten._weight_int8pack_mm"
        elif self.device == "cpu":
            lin_kernel = "quantized.int4mm_packed_weight_cpu (aten._weight_int4pack_mm_for_cpu)"
        else:
            lin_kernel = "aten._weight_int4pack_mm (tinygemm)"
        return {
            "linear": describe(lin, lin_kernel, self.blocks),
            "embedding": describe(self.options.embedding, "gather + scale", False),
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
        graph = edit.graph
        # (activation, width) -> its 2-D, kernel-dtype version, zero-padded to the width
        inputs: dict[tuple[Node, int], Node] = {}
        emit = partial(emit_node, graph)

        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target is aten.linear.default:
                weight = node.args[1]
                scheme = self.options.linear
            elif node.target is aten.embedding.default and self.options.embedding:
                weight = node.args[0]
                scheme = self.options.embedding
            else:
                continue
            lifted = edit.weight(weight)
            if lifted is None:
                continue  # computed weight: not ours to quantize
            target, source = lifted
            name = op_name(node, target)
            self.seen.update((name, target))
            names = (name, target)
            pattern = next((p for p in self.options.skip if _matches(p, names)), None)
            if pattern is not None:
                self.skipped[name] = f"skip pattern {pattern!r}"
                continue
            if node.target is aten.linear.default:
                scheme = next((s for p, s in self.options.overrides if _matches(p, names)), scheme)
            if scheme is None:
                continue
            device = source.device.type
            in_features = source.shape[-1]
            blocks = self.blocks and node.target is aten.linear.default
            if blocks:
                in_features = block_dot.in_features(in_features, 4 if scheme.kind == "int4" else 8)
                if in_features > block_dot.MAX_IN_FEATURES:
                    self.skipped[name] = f"block kernels take <= {block_dot.MAX_IN_FEATURES} inputs"
                    continue
            elif scheme.kind == "int4":
                in_features, problem = int4_in_features(*source.shape, scheme.groupsize, device)
                if problem:
                    self.skipped[name] = f"int4: {problem}"
                    continue
            elif node.target is aten.linear.default:  # an embedding row is never padded
                in_features = int8_in_features(in_features, device)
            if in_features != source.shape[-1]:
                self.padded[name] = (source.shape[-1], in_features)
            hessian = self._hessian(source) if node.target is aten.linear.default else None
            q = self._quantize(source, scheme, device, hessian, in_features, blocks)
            # A tied weight can be GPTQ-rounded as lm_head and rounded to nearest as the
            # embedding: two tensors, two names.
            prefix = f"{target}_gptq" if hessian is not None else target
            nodes = {sfx: edit.add(f"{prefix}_{sfx}", t) for sfx, t in q.tensors.items()}
            if scheme.kind == "int4" and not blocks:
                g = scheme.groupsize
                nodes["groupsize"] = edit.add(f"int4_groupsize_{g}", self._groupsize(g))
            with graph.inserting_before(node):
                if node.target is aten.linear.default:
                    out = self._linear(
                        node, nodes, scheme, device, emit, inputs, in_features, blocks
                    )
                else:
                    out = self._embedding(node, nodes, emit)
            node.replace_all_uses_with(out)
            graph.erase_node(node)
            self.quantized[name] = scheme.label
        return edit.finish()

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
            act = self.act_dtype
            if blocks:
                int4 = scheme.kind == "int4"
                q, s = (block_dot.quantize_int4 if int4 else block_dot.quantize_int8)(w)
                tensors = {f"{scheme.kind}b32": q, f"{scheme.kind}b32_scales": s}
            elif scheme.kind == "int8":
                q, s = quantize_int8(w, act)
                if hessian is not None:
                    scale = s.float()[:, None].expand_as(q)
                    zero = torch.zeros_like(scale)
                    q = gptq_codes(w, hessian, scale, zero, -128, 127).to(torch.int8)
                tensors = {"int8": q, "int8_scales": s}
            else:
                g = scheme.groupsize
                importance = None if hessian is None else torch.diagonal(hessian)
                q, sz = quantize_int4(w, g, act, importance=importance)
                if hessian is not None:
                    scale, zero = sz.float().transpose(0, 1).repeat_interleave(g, dim=1).unbind(-1)
                    q = gptq_codes(w, hessian, scale, zero, 0, 15, offset=8)
                sfx = f"int4g{g}"
                tensors = {sfx: pack_int4(q, device), f"{sfx}_scales_zeros": sz.to(device)}
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            self._cache[key] = _Quantized(tensors, scheme, nbytes)
            if not any(t is source for t in self._keep[:-1]):  # a tied weight counts once
                self.float_bytes += source.numel() * source.element_size()
            self.quant_bytes += nbytes
        return self._cache[key]

    def _linear(
        self,
        node: Node,
        consts: dict[str, Node],
        scheme: Scheme,
        device: str,
        emit: Any,
        inputs: dict[tuple[Node, int], Node],
        in_features: int,
        blocks: bool = False,
    ) -> Node:
        x, _w, *rest = node.args
        bias = rest[0] if rest else None
        x_val, out_val = x.meta["val"], node.meta["val"]
        k, n = x_val.shape[-1], out_val.shape[-1]
        lead = list(x_val.shape[:-1])
        # The kernels take 2-D activations; a single dynamic dim (the token count) is -1.
        if sum(not isinstance(d, int) for d in lead) <= 1:
            out_shape = [d if isinstance(d, int) else -1 for d in lead] + [n]
        else:
            out_shape = [
                d if isinstance(d, int) else emit(node, aten.sym_size.int, x, i)
                for i, d in enumerate(lead)
            ] + [n]
        act = self.act_dtype
        # q/k/v (and gate/up) read the same activation: cast it once, not once per op.
        if (x, k) not in inputs:
            h = emit(node, aten.view.default, x, [-1, k])
            if x_val.dtype != act:
                h = emit(node, aten._to_copy.default, h, dtype=act)
            inputs[(x, k)] = h
        if (x, in_features) not in inputs:  # zero columns for the weight's padding
            pad = [0, in_features - k]
            inputs[(x, in_features)] = emit(node, aten.constant_pad_nd.default, inputs[(x, k)], pad)
        h = inputs[(x, in_features)]
        if blocks:
            sfx = f"{scheme.kind}b32"
            h = emit(node, block_dot.OP_FOR[scheme.kind], h, consts[sfx], consts[f"{sfx}_scales"])
        elif scheme.kind == "int8":
            # CPU and CUDA (AOTI has a C shim for both).
            h = emit(
                node, aten._weight_int8pack_mm.default, h, consts["int8"], consts["int8_scales"]
            )
        elif device == "cpu":
            # The same kernel as `aten._weight_int4pack_mm_for_cpu`, whose Inductor lowering
            # would add the group size as an anonymous runtime constant the package cannot
            # bind; this op takes it as a (small, inlined) tensor. See `_register_int4_lowering`.
            sfx = f"int4g{scheme.groupsize}"
            h = emit(
                node,
                torch.ops.quantized.int4mm_packed_weight_cpu.default,
                h,
                consts[sfx],
                consts["groupsize"],
                consts[f"{sfx}_scales_zeros"],
            )
        else:  # tinygemm on CUDA
            sfx = f"int4g{scheme.groupsize}"
            h = emit(
                node,
                aten._weight_int4pack_mm.default,
                h,
                consts[sfx],
                scheme.groupsize,
                consts[f"{sfx}_scales_zeros"],
            )
        if out_val.dtype != act:
            h = emit(node, aten._to_copy.default, h, dtype=out_val.dtype)
        h = emit(node, aten.view.default, h, out_shape)
        if bias is not None:
            h = emit(node, aten.add.Tensor, h, bias)
        return h

    def _embedding(self, node: Node, consts: dict[str, Node], emit) -> Node:
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
    return QuantizePass(options, device) if options else None


def quantize_passes(raw: dict[str, Any] | None, device: str = "cpu") -> list[QuantizePass]:
    """The builder's hook: the graph passes a `quantize:` mapping asks for."""
    qp = quantize_pass(raw, device)
    return [qp] if qp else []
