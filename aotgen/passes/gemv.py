"""Few-token matmuls as Inductor-generated reductions instead of BLAS / extern kernels.

For decode (1 token) every linear is bound by reading its weight once. For verify (k + 1
tokens) on a small CPU it is bound by the k + 1 multiply-adds per weight: on a 2-vCPU
AMD EPYC a 5-row fp32 linear runs ~14 GB/s per core, as fast from L2 as from DRAM
(docs/benchmarks.md). BLAS does badly at both on that CPU (where MKL takes its generic
path): sgemv streamed ~9 GB/s per core, and for 5 rows sgemm copies (packs) the whole
weight on every call (perf: 27 % of a verify step in `mkl_blas_def_sgemm_scopy_right16_bdz`).

Written as `(x[t] * W).sum(-1)` for each of the T rows, Inductor emits one fused, vectorised
loop per weight that loads each weight element once and keeps T accumulators. The rows
must be materialised first (see the `as_strided` below). Measured on SmolLM2-135M fp32,
2 threads: decode 25 -> 16.8 ms/token, verify (5 tokens) 84 -> 35 ms; the same rewrite of
the int8 kernel took int8 decode 16.5 -> 8.9 ms.

With one token there is one accumulator: a chain of dependent vector adds that bounds the
loop by add latency (perf: the samples sit on the add and the loop compare), not memory.
So 1-token linears reduce 4 equal slices of the weight side by side (`row_groups`), which
Inductor fuses into one loop with 4 accumulators: an int8 weight streamed 15-23 -> 30 GB/s
in a micro-benchmark, and int8 decode went 7.6-8.7 -> 6.6-6.9 ms/token.

int8 weights are read as 32-bit words (a float32 view, so the loads are full vectors) and
split into their 4 bytes with shifts: Inductor loads 8 int8 lanes through a stack buffer on
AVX2 (`Vectorized<int8_t>::loadu(ptr, 8)`), which held a [49152, 576] int8 head at ~2 GB/s
(15.1 -> 1.8 ms per 1-token call with words, docs/quantization.md).

With several rows, every output reads all of them: once they outgrow L1 (7 rows x 1536
inputs = 43 KB, SmolLM2's down_proj in a verify step) the input axis is reduced in slices
that fit (`k_chunks`), partial sums first, then their sum.

Tried and reverted: the k + 1 tokens as one reduction with the token axis innermost
(`out[n, t] = sum_k W[n, k] * x[t, k]`) compiled to a verify step 30x slower.
Prefill keeps BLAS / the extern kernels: there the weight is reused across many tokens. So do
bfloat16 weights with several rows on a CPU with AMX tiles (`amx_matmul_faster`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from aotgen.passes.fx import emit, float32_result, is_cast_from_float32

aten = torch.ops.aten

MAX_ROWS = 8  # beyond this the unrolled kernel grows and BLAS reuse starts to pay
CHAINS = 4  # independent accumulators wanted per loop iteration (see row_groups)
ROWS_BYTES = 16 * 1024  # the slice of the rows that each output reads in turn: fits L1


def row_groups(n: int, rows: int, chains: int = CHAINS) -> int:
    """How many equal slices of the weight's `n` output rows to reduce side by side.

    Inductor fuses reductions with the same ranges into one loop with one accumulator
    each; a single row's reduction is one chain of dependent vector adds, which bounds a
    1-token decode by add latency, not memory. `rows` token rows already give `rows`
    chains; slices of the weight give the rest (only equal slices fuse).
    """
    groups = max(1, chains // rows)
    while n % groups:
        groups -= 1
    return groups


def k_chunks(k: int, rows: int) -> int:
    """How many equal slices of the input axis (each a multiple of 64 wide) to reduce one
    after the other so that `rows` float32 rows of a slice fit in ROWS_BYTES; 1 if none do.

    Every output reads all the rows: at 7 x 1536 (SmolLM2's down_proj in a verify step)
    they are 43 KB, more than a 32 KB L1 holds next to the weight stream.
    """
    for chunks in range(1, k // 64 + 1):
        width = k // chunks
        if k % chunks == 0 and (chunks == 1 or width % 64 == 0) and rows * width * 4 <= ROWS_BYTES:
            return chunks
    return 1


def _int8_bytes(add: Callable[..., Node], words: Node) -> list[Node]:
    """The 4 int8 weights in each int32 word, sign-extended and as float32: byte b of word j
    is w[:, 4j + b] (little-endian)."""
    return [
        add(
            aten._to_copy.default,
            add(
                aten.bitwise_right_shift.Tensor_Scalar,
                words if b == 3 else add(aten.bitwise_left_shift.Tensor_Scalar, words, 24 - 8 * b),
                24,
            ),
            dtype=torch.float32,
        )
        for b in range(4)
    ]


def _dot_terms(add: Callable[..., Node], xs: list[Node], weights: list[Node]) -> Node:
    """x_0 * w_0 + x_1 * w_1 + ... (one term for a float weight, one per byte for int8
    words): one fused elementwise chain under the reduction."""
    total = add(aten.mul.Tensor, xs[0], weights[0])
    for x, w in zip(xs[1:], weights[1:], strict=True):
        total = add(aten.add.Tensor, total, add(aten.mul.Tensor, x, w))
    return total


def _input_slice_sums(
    add: Callable[..., Node], dense: Node, weight: Node, rows: int, chunks: int
) -> list[Node]:
    """Each row's dot products as [chunks, n] partial sums over slices of the input axis (a
    view of the weight), then their sum (see `k_chunks`): a verify step 39.4 -> 36.8 ms
    (SmolLM2 fp32, 7 rows, AVX-512, 9 interleaved pairs). Inductor still orders the loop
    output, slice, input (by the weight's strides), so each output's run over the rows is a
    third as long, not slice-outermost."""
    n, k = weight.meta["val"].shape
    width = k // chunks
    sliced = add(aten.view.default, weight, [n, chunks, width])
    sliced = add(aten.permute.default, sliced, [1, 0, 2])
    sums = []
    for r in range(rows):
        xr = add(aten.as_strided.default, dense, [chunks, 1, width], [width, 0, 1], r * k)
        per_slice = add(aten.sum.dim_IntList, add(aten.mul.Tensor, xr, sliced), [-1])
        sums.append(add(aten.sum.dim_IntList, per_slice, [0]))
    return sums


def _output_slice_sums(
    add: Callable[..., Node], dense: Node, weight: Node, rows: int, pieces: int
) -> list[Node]:
    """Each row's dot products over slices of the weight's outputs (views, no copy), reduced
    side by side (see `row_groups`); `pieces` 4: int8 weights as 32-bit words."""
    n, width = weight.meta["val"].shape
    groups = row_groups(n, rows)
    size = n // groups
    parts = (
        [add(aten.slice.Tensor, weight, 0, g * size, (g + 1) * size) for g in range(groups)]
        if groups > 1
        else [weight]
    )
    parts = [
        _int8_bytes(add, add(aten.view.dtype, p, torch.int32)) if pieces == 4 else [p]
        for p in parts
    ]
    sums = []
    for r in range(rows):
        xs = [
            add(aten.as_strided.default, dense, [width], [1], (pieces * r + b) * width)
            for b in range(pieces)
        ]
        dots = [add(aten.sum.dim_IntList, _dot_terms(add, xs, w), [-1]) for w in parts]
        sums.append(dots[0] if groups == 1 else add(aten.cat.default, dots))
    return sums


@dataclass(frozen=True)
class FewRowLinear:
    """A linear (or int8 weight-only matmul) that `linears_as_reductions` rewrites."""

    x: Node
    weight: Node
    bias: Node | None
    scales: Node | None  # int8 only
    lead: list[int]  # x's static leading dims
    rows: int
    k: int


def _few_row_linear(node: Node, max_rows: int) -> FewRowLinear | None:
    """The node as a linear of <= `max_rows` static rows that the reduction should run."""
    if node.op != "call_function":
        return None
    if node.target == aten.linear.default:
        x, weight, *rest = node.args
        bias, scales = (rest[0] if rest else None), None
    elif node.target == aten._weight_int8pack_mm.default:
        x, weight, scales = node.args
        bias = None
    else:
        return None
    x_val = x.meta["val"]
    lead = list(x_val.shape[:-1])
    if not all(isinstance(d, int) for d in lead) or math.prod(lead) > max_rows:
        return None
    rows, k = math.prod(lead), x_val.shape[-1]
    if rows > 1 and amx_matmul_faster(weight.meta["val"].dtype):
        return None
    return FewRowLinear(x, weight, bias, scales, lead, rows, k)


def linears_as_reductions(ep: ExportedProgram, max_rows: int = MAX_ROWS) -> ExportedProgram:
    """Rewrite `aten.linear` and int8 weight-only matmuls with <= `max_rows` static rows.

    Dynamic-shape matmuls (prefill) and int4 ops are left as they are. The int8 kernel
    (`_weight_int8pack_mm`, bf16 activations) becomes `(x.float() * w_int8.float()).sum(-1)
    * scale` in float32: the same stream of int8 weights without the kernel's overhead (read
    as 32-bit words when K % 4 == 0, see `_int8_bytes`).
    """
    graph = ep.graph_module.graph
    for node in list(graph.nodes):
        linear = _few_row_linear(node, max_rows)
        if linear is None:
            continue
        with graph.inserting_before(node):
            out = _as_reduction(partial(emit, graph, node), node, linear)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
    ep.graph_module.recompile()
    return ep


def _as_reduction(add: Callable[..., Node], node: Node, linear: FewRowLinear) -> Node:
    """The linear's output as multiply-and-sum reductions, emitted before `node`."""
    x, weight, scales, rows, k = linear.x, linear.weight, linear.scales, linear.rows, linear.k
    # Rows taken with as_strided from a fresh contiguous copy: Inductor's as_strided
    # lowering materialises its input, so the rows are computed once. Otherwise the
    # producer (e.g. an RMSNorm) is inlined into the reduction and recomputed for
    # every output row: that made a verify step's 49k-row head 2x slower.
    if scales is not None and is_cast_from_float32(x):
        x = x.args[0]  # the bf16 cast was for the kernel; the reduction reads float32
    dense = add(aten.clone.default, x, memory_format=torch.contiguous_format)
    if scales is not None:
        dense = add(aten._to_copy.default, dense, dtype=torch.float32)
    pieces = 4 if scales is not None and k % 4 == 0 and sys.byteorder == "little" else 1
    if pieces == 4:
        # int8 as 32-bit words: (x[t] * w).sum(-1) == sum_b (x_b[t] * byte_b(w)).sum(-1)
        # with x_b[t][j] = x[t][4j + b], the rows regrouped once (a [rows, 4, k/4]
        # copy). The words are a float32 view so that Inductor loads full vectors.
        dense = add(aten.view.default, dense, [rows, k // 4, 4])
        dense = add(aten.permute.default, dense, [0, 2, 1])
        dense = add(aten.clone.default, dense, memory_format=torch.contiguous_format)
        weight = add(aten.view.dtype, weight, torch.float32)
    elif scales is not None:
        weight = add(aten._to_copy.default, weight, dtype=torch.float32)
    chunks = k_chunks(k, rows) if rows > 1 and pieces == 1 else 1
    if chunks > 1:
        sums = _input_slice_sums(add, dense, weight, rows, chunks)
    else:
        sums = _output_slice_sums(add, dense, weight, rows, pieces)
    out = add(aten.stack.default, sums)
    if scales is not None:
        out = add(aten.mul.Tensor, out, add(aten._to_copy.default, scales, dtype=torch.float32))
    out = add(aten.reshape.default, out, [*linear.lead, -1])
    if linear.bias is not None:
        out = add(aten.add.Tensor, out, linear.bias)
    # The int8 sum is float32: the quantize pass's output cast is dropped, as the input cast.
    return float32_result(add, node, out)


def int8_linears_for_gpu(ep: ExportedProgram, max_rows: int = MAX_ROWS) -> ExportedProgram:
    """CUDA: int8 weight-only matmuls (`_weight_int8pack_mm`) in float32, as gpt-fast writes
    them, for Inductor to fuse the dequantization into its own kernels. PyTorch's CUDA kernel
    ran SmolLM2 int8 decode at half the fp32 speed and prefill at a fifth (docs/cuda.md).

    Up to `max_rows` static rows (decode, verify, tree): `(x[t] * w.float()).sum(-1) * s`,
    one Triton reduction that reads each int8 weight once a row. More (prefill):
    `x @ w.float().T * s`, a fused dequantization feeding cuBLAS, whose matmul is
    compute-bound there anyway.
    """
    graph = ep.graph_module.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != aten._weight_int8pack_mm.default:
            continue
        x, weight, scales = node.args
        rows = x.meta["val"].shape[0]  # the quantize pass hands the kernel [rows, K]
        add = partial(emit, graph, node)
        with graph.inserting_before(node):
            if is_cast_from_float32(x):
                x = x.args[0]  # the bf16 cast was for the kernel
            x = add(aten._to_copy.default, x, dtype=torch.float32)
            w = add(aten._to_copy.default, weight, dtype=torch.float32)
            if isinstance(rows, int) and rows <= max_rows:
                terms = add(aten.mul.Tensor, add(aten.unsqueeze.default, x, 1), w)
                out = add(aten.sum.dim_IntList, terms, [-1])
            else:
                out = add(aten.mm.default, x, add(aten.t.default, w))
            out = add(aten.mul.Tensor, out, add(aten._to_copy.default, scales, dtype=torch.float32))
            out = float32_result(add, node, out)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
    ep.graph_module.recompile()
    return ep


def amx_matmul_faster(dtype: torch.dtype) -> bool:
    """bfloat16 weights times several rows stay on oneDNN's bfloat16 matmul where the CPU has
    AMX tiles: SmolLM2 bf16's 5-row verify step took 44.7 ms as reductions (each row re-reads
    the weight), 24.1 ms on oneDNN (Intel Xeon, Sapphire Rapids class, 2 threads). One row
    stays a reduction: it streams the weight at memory speed (decode 11.3 ms), where
    oneDNN's 1-row matmuls took 18 ms for the layers alone."""
    return dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported()
