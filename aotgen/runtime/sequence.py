"""One request's output: accepted token ids in, streamed text out, and when it ends.

Both engines feed each model step's accepted tokens through a `TokenSink`: the single-request
`Engine` and the batch engine's per-request `Sequence`, so eos, stop strings, `max_new_tokens`
and streaming behave the same whether a request is served alone or in a batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from aotgen.runtime.logprobs import TokenLogprob, token_logprobs
from aotgen.runtime.proposers import Proposer
from aotgen.runtime.sampling import make_generator
from aotgen.runtime.speculative import SpecStats
from aotgen.runtime.tokenizer import StreamDecoder, Tokenizer

if TYPE_CHECKING:  # engine.py imports this module
    from aotgen.runtime.engine import GenerationConfig
    from aotgen.runtime.rules import TokenRules


class StopText:
    """Streams text while holding back anything that could still become a stop string."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.armed_at = 0  # a stop string counts only if it ends past this (min_tokens)
        self.matched: str | None = None  # the stop string that ended the text

    def add(self, piece: str) -> str:
        self.text += piece
        for s in self.stops:
            i = self.text.find(s, max(0, self.emitted - len(s), self.armed_at - len(s) + 1))
            if i >= 0:
                self.text = self.text[:i]
                self.matched = s
                return self.flush()
        safe = len(self.text) - self.hold if self.stops else len(self.text)
        out = self.text[self.emitted : max(safe, self.emitted)]
        self.emitted += len(out)
        return out

    def flush(self) -> str:
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out


class TokenSink:
    """Accepts generated ids until eos, a stop string or stop token, or `max_new_tokens`;
    streams the text. A stop token, like eos, ends the answer without joining it. Stop
    strings count from the `min_tokens`-th token's text on, as in vLLM (the rules keep eos
    and stop tokens out until then: runtime/rules.py)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_new_tokens: int,
        stop: tuple[str, ...] = (),
        ignore_eos: bool = False,
        on_text: Callable[[str], None] | None = None,
        stop_token_ids: tuple[int, ...] = (),
        min_tokens: int = 0,
    ):
        self.eos = set() if ignore_eos else tokenizer.eos_ids
        self.stop_ids = set(stop_token_ids)
        self.stream = StreamDecoder(tokenizer)
        self.stop = StopText(stop)
        self.max_new_tokens = max_new_tokens
        self.min_tokens = min_tokens
        self.on_text = on_text
        self.ids: list[int] = []
        self.finish_reason: str | None = None  # "eos" | "stop" | "length" once done
        self.stop_reason: str | int | None = None  # the stop string or stop token that ended it

    @classmethod
    def for_request(
        cls, tokenizer: Tokenizer, config: GenerationConfig, on_text: Callable[[str], None] | None
    ) -> TokenSink:
        """The sink of a request: its length, stop strings and tokens, eos unless ignored."""
        return cls(
            tokenizer,
            config.max_new_tokens,
            config.stop,
            config.ignore_eos,
            on_text,
            config.stop_token_ids,
            config.min_tokens,
        )

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.stop.text

    def add(self, tokens: list[int]) -> bool:
        """Take one step's accepted tokens (those past the end are dropped); True when done."""
        for tok in tokens:
            if tok in self.eos or tok in self.stop_ids:
                self.finish_reason = "eos" if tok in self.eos else "stop"
                self.stop_reason = None if tok in self.eos else tok
                break
            self.ids.append(tok)
            piece = self.stream.put(tok)
            if len(self.ids) <= self.min_tokens:
                self.stop.armed_at = len(self.stop.text) + len(piece)
            self._emit(self.stop.add(piece))
            if self.stop.matched is not None:
                self.finish_reason, self.stop_reason = "stop", self.stop.matched
                break
            if len(self.ids) >= self.max_new_tokens:
                self.finish_reason = "length"
                break
        if self.done and self.stop.matched is None:
            self._emit(self.stop.add(self.stream.flush()) + self.stop.flush())
        return self.done

    def close(self, reason: str) -> None:
        """End early (the caller cancelled, or the step failed): flush what is held back."""
        if not self.done:
            self.finish_reason = reason
            self._emit(self.stop.add(self.stream.flush()) + self.stop.flush())

    def _emit(self, piece: str) -> None:
        if piece and self.on_text:
            self.on_text(piece)


@dataclass
class Sequence:
    """A request in the batch engine: its slot in the KV cache and how far it has got.

    `pos` counts the tokens in the cache. While prefilling, the prompt's tokens go in chunks;
    after that `pending` is the last sampled token, not yet in the cache (it is the next
    step's input at position `pos`)."""

    id: int
    prompt: list[int]
    sink: TokenSink
    config: GenerationConfig
    on_done: Callable[[Sequence], None] | None = None
    slot: int = -1
    pos: int = 0
    cached_tokens: int = 0  # prompt tokens its slot already held (runtime/cached_tokens.py)
    pending: int | None = None
    generator: torch.Generator = field(init=False)
    proposer: Proposer | None = None  # speculative requests: made at their first decode
    rules: TokenRules | None = None  # its penalties and grammar (runtime/rules.py)
    logprobs: list[TokenLogprob] | None = field(init=False)  # with config.logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = field(init=False)  # the first: None
    history: list[int] = field(init=False)
    spec: SpecStats | None = None
    cancelled: bool = False
    error: str | None = None
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None

    def __post_init__(self) -> None:
        self.generator = make_generator(self.config.sampling.seed)
        self.history = list(self.prompt)
        self.logprobs = None if self.config.logprobs is None else []
        self.prompt_logprobs = None if self.config.prompt_logprobs is None else [None]

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.prompt)

    @property
    def last_prompt_token(self) -> bool:
        """Only the prompt's last token is left to run: it runs in the step's decode, beside
        the requests decoding, and chooses the first new token."""
        return self.pos == len(self.prompt) - 1 and self.config.max_new_tokens > 0

    @property
    def decode_input(self) -> int:
        """The token a decode step runs at `pos`."""
        return self.prompt[-1] if self.prefilling else self.pending

    @property
    def done(self) -> bool:
        return self.sink.done

    def accept(self, tokens: list[int], rows: torch.Tensor) -> None:
        """One step's tokens, and the logits rows that chose them: the last token becomes
        the next step's input."""
        if self.first_token is None:
            self.first_token = time.perf_counter()
        self.pending = tokens[-1]
        self.history.extend(tokens)
        before = len(self.sink.ids)
        self.sink.add(tokens)
        if self.logprobs is not None:
            self.logprobs += token_logprobs(rows, self.sink.ids[before:], self.config.logprobs)
