"""Weight-only int8 of latent attention's `kv_b_proj` (model/mla.py), per row (symmetric,
round to nearest), applied to the model before export.

The graph quantization pass rewrites linears; `kv_b_proj` is read per head (its key rows
folded into the queries, its value rows expanding the attended latent), so a recipe that
quantizes the linears gets it int8 here, even with int4 linears: it is a few percent of a
layer's weights that every head's keys and values pass through. Kept float, it was a sixth of
the bytes an int8 decode step read (docs/benchmarks.md, "Latent attention").

Few-row calls (decode, verify, trees, batches) multiply and sum in float32, a reduction
Inductor fuses with the int8 load, so each code is read once and never widened in memory;
prefill and the expanded path widen the rows once a call and multiply.
"""

from __future__ import annotations

import fnmatch

from torch import Tensor, nn

from aotgen.model.mla import LatentExpansion
from aotgen.passes.gemv import MAX_ROWS
from aotgen.passes.quantize_experts import int8_rows


class Int8LatentExpansion(nn.Module):
    """`LatentExpansion` as int8 codes [heads * (nope + v_dim), rank] and a float32 scale a
    row. A key row's scale multiplies the query dim it meets, a value row's its output."""

    def __init__(self, expansion: LatentExpansion):
        super().__init__()
        self.heads, self.nope, self.v_dim = expansion.heads, expansion.nope, expansion.v_dim
        codes, scale = int8_rows(expansion.weight.detach())
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)

    def forward(self, latent: Tensor) -> Tensor:
        weight = (self.codes.float() * self.scale[:, None]).to(latent.dtype)
        return latent @ weight.t()

    def fold_keys(self, q_nope: Tensor) -> Tensor:
        codes, scale = self._per_head()
        x = q_nope.float() * scale[:, None, : self.nope]  # [b, heads, t, nope]
        w = codes[:, : self.nope]  # [heads, nope, rank]
        if _few_rows(x):
            y = (x.unsqueeze(-1) * w.unsqueeze(1).float()).sum(-2)
        else:
            y = x @ w.float()
        return y.to(q_nope.dtype)

    def expand_values(self, y: Tensor) -> Tensor:
        codes, scale = self._per_head()
        x, w = y.float(), codes[:, self.nope :]  # [b, heads, t, rank], [heads, v_dim, rank]
        if _few_rows(x):
            out = (x.unsqueeze(-2) * w.unsqueeze(1).float()).sum(-1)
        else:
            out = x @ w.float().transpose(1, 2)
        return (out * scale[:, None, self.nope :]).to(y.dtype)

    def _per_head(self) -> tuple[Tensor, Tensor]:
        rows = self.nope + self.v_dim
        return self.codes.view(self.heads, rows, -1), self.scale.view(self.heads, rows)


def _few_rows(x: Tensor) -> bool:
    """A static number of rows a head small enough for a reduction (passes/gemv.py)."""
    b, _, t = x.shape[:3]
    return isinstance(b, int) and isinstance(t, int) and b * t <= MAX_ROWS


def quantize_latent(model: nn.Module, skip: tuple[str, ...] = ()) -> dict[str, str | None]:
    """Every `LatentExpansion` swapped for its int8 version, but where a `quantize.skip` glob
    matches its module path; returns each path's outcome: None (int8) or the pattern."""
    outcomes: dict[str, str | None] = {}
    for path, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, LatentExpansion):
                continue
            full = f"{path}.{name}" if path else name
            outcomes[full] = next((p for p in skip if fnmatch.fnmatchcase(full, p)), None)
            if outcomes[full] is None:
                setattr(module, name, Int8LatentExpansion(child))
    return outcomes
