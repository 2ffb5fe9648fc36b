"""One model of a package as the runtime runs it: its compiled graphs (AOTInductor, or ONNX
Runtime), its weights bound once, its KV cache and what the cache holds.

Like the engine, imports no model code (`tests/test_runtime_isolation.py`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import Tensor

from aotgen.package.manifest import PackageError, kv_dtypes
from aotgen.package.weights import is_padding
from aotgen.runtime.cached_tokens import CachedTokens
from aotgen.runtime.cuda_graph import ReplayedGraph
from aotgen.runtime.graph_loader import open_loader
from aotgen.runtime.onnx_backend import onnx_graphs
from aotgen.runtime.tree import Tree


class GenerationError(ValueError):
    """A request the package cannot serve (e.g. longer than its context)."""


class CompiledGraph:
    """One AOTInductor graph; checks the token count (and batch size) it was compiled for."""

    def __init__(
        self, pt2: Path, package_model: str, signature: dict[str, Any], device: torch.device
    ):
        self.name = package_model
        self.min_tokens = signature["tokens"]["min"]
        self.max_tokens = signature["tokens"]["max"]
        batch = signature.get("batch", {"min": 1, "max": 1})
        self.min_batch, self.max_batch = batch["min"], batch["max"]
        # Graphs that take the cache positions they attend (`key_pos`) read nothing back to the
        # host: on a GPU they can be replayed as CUDA graphs (runtime/cuda_graph.py).
        self.key_pos: Tensor | None = None
        if signature.get("attention") == "key_pos":
            caches = next(i for i in signature["inputs"] if i["name"] == "kv_caches")
            self.key_pos = torch.arange(caches["shapes"][0][2], device=device)
        self.replayable = device.type == "cuda" and self.key_pos is not None
        self.loader = open_loader(pt2, package_model, device)

    def bind(self, weights: dict[str, Tensor]) -> None:
        names = self.loader.get_constant_fqns()
        missing = [n for n in names if n not in weights]
        if missing:
            raise PackageError(
                f"graph {self.name} needs weights missing from the package: {missing}"
            )
        # user_managed: the graph uses our tensors, so all graphs share one copy.
        self.loader.load_constants({n: weights[n] for n in names}, False, True, True)

    def __call__(
        self,
        tokens: Tensor,
        input_pos: Tensor,
        caches: list[Tensor],
        tree_mask: Tensor | None = None,
        slots: Tensor | None = None,
        attend: int | None = None,
    ) -> Tensor:
        """`attend`: the call reads cache positions below it (default: the whole cache)."""
        b, t = tokens.shape
        if not self.min_tokens <= t <= self.max_tokens:
            raise ValueError(
                f"{self.name} takes {self.min_tokens}..{self.max_tokens} tokens, got {t}"
            )
        if not self.min_batch <= b <= self.max_batch:
            raise ValueError(
                f"{self.name} takes {self.min_batch}..{self.max_batch} sequences, got {b}"
            )
        key_pos = None if self.key_pos is None else self.key_pos[: self.span(attend)]
        extra = [x for x in (tree_mask, slots, key_pos) if x is not None]
        return self.loader.boxed_run([tokens, input_pos, *caches, *extra])[0]

    def span(self, attend: int | None) -> int:
        """How many cache positions a graph that takes `key_pos` attends for a call that reads
        those below `attend`: one of a few spans (`key_span`), so that a replayed graph has a
        few captures, not one per position."""
        assert self.key_pos is not None
        cache_len = len(self.key_pos)
        return cache_len if attend is None else key_span(attend, cache_len)


# Spans a graph that takes `key_pos` attends over: powers of two from 128, then the whole
# cache; a span is at most twice the attended length, so attention grows with the position,
# not with the cache (SmolLM2 with a 2,056-position cache on an H100: decode 2-5 % faster than
# over the whole cache; docs/cuda.md).
MIN_KEY_SPAN = 128


def key_span(attend: int, cache_len: int) -> int:
    """The shortest span that covers cache positions below `attend`."""
    return min(max(MIN_KEY_SPAN, 1 << (attend - 1).bit_length()), cache_len)


def zeros_on_demand(
    shape: list[int], dtype: torch.dtype, device: str | torch.device = "cpu"
) -> Tensor:
    """A zero tensor on pages the OS zero-fills when first written (numpy allocates with calloc).

    KV caches start zeroed, as with torch.zeros, but are written only as far as the context
    reaches; torch.zeros would write all `cache_len` positions at load. GPU memory has no
    such pages: there it is torch.zeros.
    """
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if not nbytes:  # a latent-attention layer's values: nothing to view
        return torch.zeros(shape, dtype=dtype)
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).reshape(shape)


def _target_cache_layers(
    kv: dict[str, Any], dtypes: list[torch.dtype], target_caches: list[Tensor] | None
) -> list[Tensor]:
    """The first `kv["layers"]` layers of the target's cache, checked against the draft's
    layout: a draft that shares must read exactly the tensors the target writes."""
    n = 2 * kv["layers"]
    if (
        target_caches is None
        or len(target_caches) < n
        # Per slot: the batch engine's caches hold several rows of the layout.
        or any(
            list(c.shape[1:]) != shape[1:] or c.dtype != dtype
            for c, shape, dtype in zip(target_caches, kv["shapes"], dtypes, strict=False)
        )
    ):
        raise PackageError(
            "the draft is built to share the target's KV cache, but the target's cache "
            f"layout differs from the draft's ({kv['layers']} layers of {kv['shapes'][0]} "
            f"{kv['dtype']}); rebuild the package"
        )
    return target_caches[:n]


class ModelRunner:
    """One model of a package: its graphs, weights bound once, and its KV cache: its own, or
    the target's for a draft built with `kv_cache.shared_with: target`. Weights, caches and
    graphs live on `device`; logits come back on the CPU, where sampling runs. On a GPU the
    fixed-width graphs are replayed as CUDA graphs unless `cuda_graphs` is off."""

    def __init__(
        self,
        root: Path,
        pt2: Path,
        entry: dict[str, Any],
        target: ModelRunner | None = None,
        device: str = "cpu",
        backend: str = "aoti",
        slots: int = 1,
        cuda_graphs: bool = True,
    ):
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device(device)
        self.config = entry["config"]
        self.vocab_size = self.config["vocab_size"]
        if backend == "onnxruntime":
            # ORT reads the ONNX graphs' own weights file; no AOTInductor code is loaded.
            self.weights: dict[str, Tensor] = {}
            self.graphs = onnx_graphs(root, entry, "target" if target is None else "draft")
        else:
            self.weights, self.graphs = self._aoti_graphs(root, pt2, entry, cuda_graphs)
        kv = entry["kv_cache"]
        self.cache_len = kv["cache_len"]
        dtypes = [getattr(torch, d) for d in kv_dtypes(kv)]
        self.shares_cache = kv.get("shared_with") == "target"
        if self.shares_cache:
            self.caches = _target_cache_layers(kv, dtypes, target.caches if target else None)
            # What each row holds (runtime/cached_tokens.py): the draft writes its own keys
            # into the target's layers, so it only makes the target's record forget them.
            self.cached = target.cached
        else:
            self.caches = [
                zeros_on_demand([slots, *shape[1:]], dtype, self.device)
                for shape, dtype in zip(kv["shapes"], dtypes, strict=True)
            ]
            ring = kv.get("ring")
            self.cached = CachedTokens(slots, ring and (ring["cells"], ring["window"]))
        # Slots: one sequence's cache rows each (the batch engine's); a row is a `[1, ...]`
        # view that the single-sequence graphs run on in place.
        self.slot_caches = (
            [self.caches]
            if slots == 1
            else [[c[s : s + 1] for c in self.caches] for s in range(slots)]
        )
        # A draft on the target's cache only ever decodes: it is built without a prefill graph.
        self.prefill_chunk = self.graphs["prefill"].max_tokens if "prefill" in self.graphs else 1
        self.verify_len = self.graphs["verify"].max_tokens if "verify" in self.graphs else 0
        self.tree_len = self.graphs["tree"].max_tokens if "tree" in self.graphs else 0
        self.score_chunk = self.graphs["score"].max_tokens if "score" in self.graphs else 0

    def _aoti_graphs(
        self, root: Path, pt2: Path, entry: dict[str, Any], cuda_graphs: bool
    ) -> tuple[dict[str, Tensor], dict[str, CompiledGraph | ReplayedGraph]]:
        """The weights, loaded once, and the AOTInductor graphs bound to them."""
        # The builder aligns every tensor to 64 bytes in the file (package/weights.py), so the
        # kernels run on the mapping in place; a misaligned tensor is copied, since misaligned
        # AVX-512 loads made decode 2.5x slower.
        weights = {
            name: t.clone() if t.data_ptr() % 64 else t
            for name, t in load_file(str(root / entry["weights"]["file"]), str(self.device)).items()
            if not is_padding(name)
        }
        for alias, name in entry["weights"]["aliases"].items():
            weights[alias] = weights[name]
        graphs = {
            name: CompiledGraph(pt2, sig["package_model"], sig, self.device)
            for name, sig in entry["graphs"].items()
        }
        for g in graphs.values():
            g.bind(weights)
        if cuda_graphs and any(g.replayable for g in graphs.values()):
            pool = torch.cuda.graph_pool_handle()
            graphs = {k: ReplayedGraph(g, pool) if g.replayable else g for k, g in graphs.items()}
        return weights, graphs  # keep the weights alive: the graphs use them in place

    def forward(
        self, tokens: list[int], start_pos: int, all_logits: bool = False, slot: int = 0
    ) -> Tensor:
        """Run `tokens` at positions start_pos.. through the fitting graph(s), in the cache of
        `slot`. Returns logits `[T, V]` for every position if `all_logits`, else for the last.
        The prefill graph returns its last row only, so every row's logits come from the
        score graph where the package has one (`score_graph: true`), else from the verify
        graph, `verify_len` tokens a call (decode where it does not fit).
        """
        caches = self.slot_caches[slot]
        end = start_pos + len(tokens)
        if end > self.cache_len:
            raise GenerationError(f"position {end} is past the KV cache ({self.cache_len})")
        step = self.prefill_chunk
        if all_logits:
            step = self.score_chunk or max(self.verify_len, 1)
        outs = []
        pos = start_pos
        while pos < end:
            n = min(end - pos, step)
            width = self._graph_width(n, pos, all_logits)
            n = min(n, width)
            chunk = tokens[pos - start_pos : pos - start_pos + n]
            many = "score" if all_logits else "prefill"
            graph = self.graphs[
                "decode" if width == 1 else "verify" if width == self.verify_len else many
            ]
            chunk += chunk[-1:] * (width - n)
            chunk_ids = torch.tensor([chunk], dtype=torch.long, device=self.device)
            positions = torch.arange(pos, pos + width, device=self.device)
            self.cached.forget(slot, pos)
            logits = graph(chunk_ids, positions, caches, attend=pos + width)[0][:n].cpu()
            self._wrote(slot, pos, chunk)
            outs.append(logits if all_logits else logits[-1:])
            pos += n
        return torch.cat(outs) if all_logits else outs[-1][0]

    def share_prefix(self, slot: int, tokens: list[int]) -> int:
        """How many leading `tokens` row `slot` holds, after copying into it what another row
        holds of them beyond its own: a system prompt shared by requests running at once
        runs once (vLLM and SGLang share such pages; a row's prefix is copied here, which
        reads a few kB per position where running it reads every weight)."""
        own = self.cached.prefix(slot, tokens)
        donor, held = self.cached.holder(tokens)
        if held <= own:
            return own
        for cache in self.caches:  # [slots, kv_heads, cache_len or ring cells, head_dim]
            rows = slice(own, held) if cache.shape[2] == self.cache_len else slice(None)
            cache[slot, :, rows].copy_(cache[donor, :, rows])
        self.cached.forget(slot, own)
        self.cached.wrote(slot, own, tokens[own:held])
        self.cached.copy_cells(donor, slot)  # a ring's cells hold what the donor's held
        return held

    def _graph_width(self, n: int, pos: int, all_logits: bool = False) -> int:
        """How many positions to run for `n` tokens at `pos`: 1 (decode), n (prefill), or the
        verify graph's width, padded, for 1 < n < verify_len. The prefill graph's BLAS calls
        are slowest at a few rows (SmolLM2 fp32: 2-4 tokens 73-136 ms, against 32 ms for the
        5-token verify graph), and a partial speculative block or a short prompt tail lands
        there. The padded positions' cache entries are never read: every graph writes its
        positions before attending, and attends only up to its last one. With `all_logits`
        the prefill graph (last row only) is no choice: the score graph, or 1 where the verify
        graph does not fit.
        """
        if 1 < n < self.verify_len and pos + self.verify_len <= self.cache_len:
            return self.verify_len
        if all_logits and n != self.verify_len and not (self.score_chunk and n > 1):
            return 1
        return n

    def tree_forward(self, tree: Tree, start: int) -> Tensor:
        """Score a token tree rooted at position `start` in one tree-graph call (padded to its
        rows): logits `[len(tree), V]`. Node i's keys/values land in slot start + i."""
        n, width = len(tree), self.tree_len
        if not 1 <= n <= width or start + width > self.cache_len:
            raise GenerationError(f"a tree of {n} nodes at {start} does not fit the tree graph")
        ids = tree.tokens + tree.tokens[-1:] * (width - n)
        positions = [start + d for d in tree.depths] + [start] * (width - n)
        dev = self.device
        self.cached.overwrote(0, start, width)  # node i sits at start + i: not a sequence
        logits = self.graphs["tree"](
            torch.tensor([ids], device=dev),
            torch.tensor(positions, device=dev),
            self.caches,
            tree.mask(width).to(dev),
            attend=start + width,
        )
        return logits[0][:n].cpu()

    def decode(self, token: int, pos: int, slot: int = 0) -> Tensor:
        """The per-token hot path: one decode call, logits `[V]`."""
        tokens = torch.tensor([[token]], device=self.device)
        positions = torch.tensor([pos], device=self.device)
        self.cached.forget(slot, pos)
        logits = self.graphs["decode"](tokens, positions, self.slot_caches[slot], attend=pos + 1)
        self._wrote(slot, pos, [token])
        return logits[0, 0].cpu()

    def decode_many(self, tokens: list[int], positions: list[int], slots: list[int]) -> Tensor:
        """One decode step for several sequences, `[B, V]`: the `batch_decode` graph for two or
        more (each weight read once for all), the decode graph for one or without it."""
        if len(tokens) == 1 or "batch_decode" not in self.graphs:
            return torch.stack(
                [self.decode(t, p, s) for t, p, s in zip(tokens, positions, slots, strict=True)]
            )
        rows = torch.tensor(tokens)[:, None], torch.tensor(positions)[:, None]
        return self.batch("batch_decode", *rows, torch.tensor(slots))[:, 0]

    def batch(self, graph: str, tokens: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
        """One batched-graph call: `tokens`, `positions` `[B, T]` in cache rows `slots [B]`;
        logits `[B, T, V]`."""
        dev = self.device
        rows = list(zip(slots.tolist(), positions[:, 0].tolist(), tokens.tolist(), strict=True))
        for slot, start, _ in rows:
            self.cached.forget(slot, start)
        logits = self.graphs[graph](
            tokens.to(dev), positions.to(dev), self.caches, None, slots.to(dev)
        ).cpu()
        for slot, start, row in rows:
            self._wrote(slot, start, row)
        return logits

    def _wrote(self, slot: int, start: int, tokens: list[int]) -> None:
        """Record a call's tokens in the cache row; a draft on the target's cache only
        forgets (its keys are not the target's)."""
        if self.shares_cache:
            self.cached.overwrote(slot, start, len(tokens))
        else:
            self.cached.wrote(slot, start, tokens)
