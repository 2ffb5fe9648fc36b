"""GPTQ (Frantar et al. 2022) for the quantize pass: choose the integers that minimise each
linear's output error on calibration text, not its weight error.

    quantize: {linear: {int4: {groupsize: 64}}, method: gptq}

Round-to-nearest treats every weight alike. GPTQ rounds one input column at a time and
moves that column's rounding error onto the columns not rounded yet, through the inverse
Hessian H = X^T X of the linear's calibration inputs, so the error lands where the inputs
can absorb it. The variant here, chosen by measurement on SmolLM2-135M int4 g64 (held-out
perplexity, fp32 24.79; the ladder is in docs/quantization.md, "GPTQ"):
- columns in order of decreasing H[j, j] (act-order), with each group's scale and zero
  fixed beforehand from the original weights ("static groups", so groups stay contiguous
  and the kernels need no column permutation);
- those group parameters fitted with diag(H) as per-column importance (llama.cpp's
  imatrix; `quantize_int4(importance=...)`);
- every Hessian taken from the float model in one pass over the calibration text
  (layer-by-layer re-collection on the partly quantized model measured the same).

Hessians are collected on the exported graph, so this works for any model the pass does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Interpreter, Node

aten = torch.ops.aten
USER = InputKind.USER_INPUT

DAMPING = 0.01  # of the mean diagonal, added to H: GPTQ's default
BLOCK = 128  # columns updated together (lazy batch updates; speed only)


def input_hessians(ep: ExportedProgram, batches: Sequence[Sequence[Any]]) -> dict[str, Tensor]:
    """X^T X (summed in float64, returned float32) of the input of every `aten.linear`
    whose weight is a lifted parameter, buffer or constant, keyed by that weight's name,
    summed over running the graph on each of `batches` (the graph's user inputs)."""
    specs = ep.graph_signature.input_specs
    weights = {**ep.state_dict, **ep.constants}
    lifted = {s.arg.name: s.target for s in specs if s.kind != USER}
    # Keyed by the input node: linears that read one input (q/k/v, gate/up) share its X^T X.
    watch: dict[Node, list[str]] = {}
    for node in ep.graph.nodes:
        if node.op == "call_function" and node.target is aten.linear.default:
            name = lifted.get(getattr(node.args[1], "name", None))
            if name is not None:
                watch.setdefault(node.args[0], []).append(name)
    sums: dict[Node, Tensor] = {}

    class _Collect(Interpreter):
        def run_node(self, n: Node) -> Any:
            out = super().run_node(n)
            if n in watch:
                # float32 within a chunk (half the float64 cost), summed over chunks in float64
                x = out.detach().reshape(-1, out.shape[-1]).float()
                h = x.T @ x
                if n in sums:
                    sums[n].add_(h)  # widened as it is added: no float64 copy per chunk
                else:
                    sums[n] = h.double()
            return out

    collect = _Collect(ep.graph_module)
    with torch.no_grad():
        for user_inputs in batches:
            user = iter(torch.utils._pytree.tree_leaves(list(user_inputs)))
            args = [next(user) if s.kind == USER else weights[s.target] for s in specs]
            collect.run(*args)
    hessians: dict[str, Tensor] = {}  # a weight that several linears use sums their inputs'
    for node, h in sums.items():
        for name in watch[node]:
            hessians[name] = hessians[name] + h if name in hessians else h
    return {name: h.float() for name, h in hessians.items()}


def gptq_codes(
    w: Tensor,
    hessian: Tensor,
    scale: Tensor,
    zero: Tensor,
    qmin: int,
    qmax: int,
    offset: int = 0,
) -> Tensor:
    """Integer codes q [N, K] for w ≈ (q - offset) * scale + zero, with scale and zero
    [N, K] (already expanded per column, fixed), chosen column by column with GPTQ's error
    feedback through `hessian` [K, K]. Columns no calibration input touched round to
    nearest."""
    n, k = w.shape
    h = hessian.clone().double()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    order = torch.argsort(torch.diag(h), descending=True)  # act-order
    h = h[order][:, order]
    # Column j of the weight is row j here: contiguous where the loop reads and writes it
    # (strided columns made the loop 1.7-3.8x slower).
    w = w.detach().float().T[order].contiguous()
    scale, zero = scale.float().T[order].contiguous(), zero.float().T[order].contiguous()
    hinv = _inverse_factor(h).float()
    q = torch.empty(k, n, dtype=torch.int32, device=w.device)
    for b0 in range(0, k, BLOCK):
        b1 = min(b0 + BLOCK, k)
        block = w[b0:b1].clone()
        errors = torch.empty_like(block)
        hb = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            j = b0 + i
            col = block[i]
            qj = ((col - zero[j]) / scale[j] + offset).round_().clamp_(qmin, qmax)
            q[j] = qj
            err = (col - ((qj - offset) * scale[j] + zero[j])) / hb[i, i]
            block[i:].addr_(hb[i, i:], err, alpha=-1)
            errors[i] = err
        w[b1:].addmm_(hinv[b0:b1, b1:].T, errors, alpha=-1)
    return q[torch.argsort(order)].T.contiguous()


def _inverse_factor(h: Tensor) -> Tensor:
    """Upper Cholesky factor of (H + damping)^-1: row j holds the update that column j's
    error makes to the columns after it (the GPTQ paper's stable reformulation). Damping
    grows tenfold until H is positive definite (little calibration text can leave it not)."""
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    for damping in (DAMPING, 10 * DAMPING, 100 * DAMPING):
        factor, info = torch.linalg.cholesky_ex(h + damping * torch.diag(h).mean() * eye)
        if int(info) == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(factor), upper=True)
    raise ValueError("GPTQ: the calibration Hessian is not positive definite even damped")
