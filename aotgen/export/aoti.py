"""torch.export + AOTInductor: the three graphs of a model, compiled without their weights.

Every graph keeps one signature, `(tokens [1, T], input_pos [T], *kv_caches) -> logits`,
and differs only in T: `prefill` (dynamic, 2..prefill_chunk), `decode` (1) and `verify`
(verify_k + 1). Weights stay out of the `.so` (`package_constants_in_so=False`): the
package stores them once, and the runtime binds that one copy to every graph.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.export import Dim, ExportedProgram


@dataclass(frozen=True)
class GraphSpec:
    name: str
    min_tokens: int
    max_tokens: int

    @property
    def dynamic(self) -> bool:
        return self.min_tokens != self.max_tokens


def graph_specs(prefill_chunk: int, verify_k: int) -> list[GraphSpec]:
    return [
        GraphSpec("prefill", 2, prefill_chunk),
        GraphSpec("decode", 1, 1),
        GraphSpec("verify", verify_k + 1, verify_k + 1),
    ]


def example_inputs(spec: GraphSpec, caches: list[Tensor]) -> tuple:
    t = spec.max_tokens if spec.dynamic else spec.min_tokens
    # Positions near the start keep the data-dependent attention length valid in tracing.
    device = caches[0].device  # the graph runs where its cache lives
    return (
        torch.zeros(1, t, dtype=torch.long, device=device),
        torch.arange(t, device=device),
        caches,
    )


def export_graph(model: nn.Module, spec: GraphSpec, caches: list[Tensor]) -> ExportedProgram:
    dynamic_shapes = None
    if spec.dynamic:
        t = Dim(f"{spec.name}_tokens", min=spec.min_tokens, max=spec.max_tokens)
        dynamic_shapes = ({1: t}, {0: t}, [None] * len(caches))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.export.export(
            model, example_inputs(spec, caches), dynamic_shapes=dynamic_shapes, strict=False
        )


def inductor_options(max_autotune: bool, device: str) -> dict:
    options = {
        "aot_inductor.package": True,
        "aot_inductor.package_constants_in_so": False,
        "max_autotune": max_autotune,
    }
    # GCC contracting multiply+add into FMA: on an AVX2-only CPU the 5-row verify reduction
    # ran 15 % faster and chat speculation 1.26-1.27x against 1.08-1.21x (session 11); on
    # the AVX-512 VM it made verify slower (25.4 -> 30.3 ms, session 4). Packages are tied
    # to the ISA they were built for, so the choice is the build machine's.
    if device == "cpu" and torch.backends.cpu.get_cpu_capability() == "AVX2":
        options["cpp.enable_floating_point_contract_flag"] = "fast"
    return options


def compile_graph(ep: ExportedProgram, args: tuple, max_autotune: bool) -> list[str]:
    """AOTInductor-compile one exported graph; returns the files for `package_aoti`."""
    import torch._inductor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch._inductor.aot_compile(
            ep.module(), args, options=inductor_options(max_autotune, args[0].device.type)
        )


def package_graphs(path: Path, files: dict[str, list[str]]) -> None:
    from torch._inductor.package import package_aoti

    package_aoti(str(path), files)


def constant_sources(ep: ExportedProgram) -> dict[str, Tensor]:
    """Every tensor the compiled graph may ask for by name: parameters, buffers, constants."""
    return {**ep.state_dict, **ep.constants}


def use_cache_dir(cache_dir: Path) -> None:
    """Keep Inductor's compile cache in the project cache so unchanged graphs rebuild fast."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(cache_dir).resolve() / "inductor"))
