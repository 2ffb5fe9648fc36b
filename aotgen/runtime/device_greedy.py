"""Greedy decoding kept on the GPU, one step ahead of the host.

A CUDA package's decode step is short (SmolLM2-135M: about 1.1-1.3 ms of GPU time on an
H100), and a host loop that copies the logits back, picks the token on the CPU and sends it
up again leaves the GPU idle for that round trip on every token (0.27-0.35 ms measured,
docs/cuda.md). Here the argmax runs on the device and writes the next step's input token
there; the host launches step i + 1 before it reads token i (an 8-byte copy to pinned
memory, behind an event), so the GPU never waits for the host. When the consumer stops, one
step was launched past its last token: it writes the cache position after the sequence's
last, which nothing reads before it is written again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from aotgen.runtime.model_runner import ModelRunner


def greedy_tokens(runner: ModelRunner, token: int, pos: int) -> Iterator[int]:
    """Greedy tokens after `token` at `pos` (not yet in the cache), decoded on the runner's
    GPU: the ids `select_next` would pick from each step's logits (argmax, first of ties on
    both devices), without the logits leaving the device."""
    device = runner.device
    decode, caches = runner.graphs["decode"], runner.slot_caches[0]  # the engine's row
    runner.cached.forget(0, pos)  # the tokens decoded here are not recorded
    tok = torch.tensor([[token]], device=device)  # [1, 1]: the next step's input
    position = torch.tensor([pos], device=device)
    picked = torch.empty(2, dtype=torch.long, pin_memory=True)  # tokens i and i + 1
    ready = [torch.cuda.Event(), torch.cuda.Event()]

    def launch(step: int, at: int) -> None:
        logits = decode(tok, position, caches, attend=at + 1)
        torch.argmax(logits[0], dim=-1, keepdim=True, out=tok)
        position.add_(1)
        picked[step % 2].copy_(tok[0, 0], non_blocking=True)
        ready[step % 2].record()

    launch(0, pos)
    launched, step = 1, 0
    while step < launched:
        if pos + launched < runner.cache_len:  # step s writes cache position pos + s
            launch(launched, pos + launched)
            launched += 1
        ready[step % 2].synchronize()
        yield int(picked[step % 2])
        step += 1
