"""Structured output: every sampled token keeps the text inside a grammar.

A request may carry a `Grammar` (a JSON schema, a regular expression, a Lark or llama.cpp
GBNF grammar, or a list of choices). Before each token is chosen, the tokens the grammar
cannot take next get probability zero; the chosen token then advances the grammar's state.
The matching is llguidance's (the engine behind llama.cpp's, vLLM's and SGLang's guided
decoding): it computes the allowed set over the whole vocabulary in about 0.1 ms
(docs/structured-output.md).

Speculative decoding keeps its guarantees: a chain proposal is cut where the grammar refuses
a token (or just after eos), and each verify row (each tree node's row) is restricted to what
the grammar allows after the tokens before it, so the accepted tokens are those the
constrained target would have chosen alone.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    import llguidance

    from aotgen.runtime.tokenizer import Tokenizer

# Grammar kinds and llguidance's name for each ("grammar": Lark, or GBNF converted to Lark;
# "llguidance": llguidance's own grammar JSON, as `Grammar.after_reasoning` composes it).
KINDS = {
    "json_schema": "json_schema",
    "regex": "regex",
    "grammar": "grammar",
    "choice": "choice",
    "llguidance": "llguidance",
}
# Reasoning before the answer (aotgen/runtime/reasoning.py): any text up to the first </think> (a
# lazy lexeme ends at the first match), then newlines.
_REASONING = "think[lazy]: /(?s:.*)<\\/think>/\nsep: /\\n*/\n"

INSTALL_HINT = "structured output needs llguidance: pip install 'aotgen[structured]'"


class GrammarError(ValueError):
    """A grammar that cannot constrain generation (bad syntax, unsupported feature)."""


@dataclass(frozen=True)
class Grammar:
    """What the generated text must match. `source` is the schema's JSON text, the regular
    expression, the grammar text, or the choices as a JSON list of strings."""

    kind: str
    source: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"grammar kind {self.kind!r}: expected one of {', '.join(KINDS)}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Grammar:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def choice(cls, options: list[str]) -> Grammar:
        return cls("choice", json.dumps(options))

    def after_reasoning(self, opened: bool) -> Grammar:
        """This grammar for the answer after the model's reasoning, which stays free: up to
        its `</think>` when the prompt opened it (`opened`), else an optional
        `<think> ... </think>` the model may open itself (Qwen3's)."""
        head = "start: think sep @answer\n" if opened else 'start: ("<think>" think sep)? @answer\n'
        return self.after(head + _REASONING)

    def after(self, lead: str) -> Grammar:
        """This grammar as the `@answer` of the Lark grammar `lead`, which says what comes
        before it (a model's free reasoning)."""
        text = self.text()  # llguidance's JSON, or Lark text (choices, grammars)
        lark = not text.lstrip().startswith("{")
        answer = [{"lark_grammar": text}] if lark else json.loads(text)["grammars"]
        main = {"name": "main", "lark_grammar": lead}
        grammars = [main, {**answer[0], "name": "answer"}, *answer[1:]]
        return Grammar("llguidance", json.dumps({"grammars": grammars}))

    def text(self) -> str:
        """llguidance's grammar text (not yet checked: the matcher compiles it)."""
        if self.kind == "llguidance":
            return self.source
        try:
            return _llguidance().grammar_from(KINDS[self.kind], self.source)
        except (ValueError, TypeError, json.JSONDecodeError) as e:
            raise GrammarError(f"invalid {self.kind}: {_one_line(e)}") from None

    def check(self) -> None:
        """GrammarError (one line) if this is not a valid grammar: for a command line to fail
        before a package loads (a request's matcher compiles it once, and says the same)."""
        error = _llguidance().LLMatcher.validate_grammar(self.text())
        if error:
            raise GrammarError(f"invalid {self.kind}: {_one_line(error)}")


def _one_line(error: object) -> str:
    return " ".join(str(error).split())


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise GrammarError(INSTALL_HINT) from None
    return llguidance


class GrammarTokens:
    """The vocabulary as llguidance sees it (built once per engine: 0.2 s for a 49k
    vocabulary), and a matcher per request."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._table: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def table(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._table is None:
                llg = _llguidance()
                self._table = llg.LLTokenizer(
                    self.tokenizer.to_json(),
                    n_vocab=self.vocab_size,
                    eos_token=sorted(self.tokenizer.eos_ids),
                )
            return self._table

    def constraint(self, grammar: Grammar) -> TokenConstraint:
        matcher = _llguidance().LLMatcher(self.table(), grammar.text(), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {grammar.kind}: {_one_line(matcher.get_error())}")
        return TokenConstraint(matcher, self.vocab_size, self.tokenizer.eos_ids)


class TokenConstraint:
    """One request's position in its grammar. Eos ends the request: where the grammar allows
    it, it is chosen like any token but never taken (nothing follows it)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos: set[int]):
        self.matcher, self.vocab_size, self.eos = matcher, vocab_size, eos

    def allowed(self) -> Tensor:
        """bool [V]: the tokens the grammar takes next."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        return torch.from_numpy(mask)

    def restrict(self, logits: Tensor) -> Tensor:
        """`logits` ([V] or [1, V]) with every token the grammar refuses at -inf."""
        return logits.masked_fill(~self.allowed().reshape(logits.shape), -math.inf)

    def advance(self, tokens: list[int]) -> None:
        """Take a step's tokens, chosen under this constraint, up to eos."""
        for tok in tokens:
            if tok in self.eos:
                return
            if not self.matcher.consume_token(tok):
                raise GrammarError(f"the grammar refused token {tok}: {self.matcher.get_error()}")

    def rollback(self, count: int) -> None:
        if count and not self.matcher.rollback(count):
            raise GrammarError(f"grammar rollback failed: {self.matcher.get_error()}")

    def over_tree(self, tokens: list[int], parents: list[int]) -> Tensor:
        """The allowed set after each node of a token tree (node 0, the root, is the current
        token), bool [n, V]: walked depth first, taking each node's token and rolling it back.
        Below a node the grammar refuses, or eos, anything (those rows are never used: such a
        node is never accepted, and nothing follows eos). The state is left as it was."""
        masks = torch.ones(len(tokens), self.vocab_size, dtype=torch.bool)
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(parents[1:], 1):
            children.setdefault(parent, []).append(node)

        def walk(node: int) -> None:
            masks[node] = self.allowed()
            for child in children.get(node, []):
                tok = tokens[child]
                if masks[node][tok] and tok not in self.eos:
                    self.advance([tok])
                    walk(child)
                    self.rollback(1)

        walk(0)
        return masks

    def along(self, tokens: list[int]) -> tuple[int, Tensor]:
        """How many leading `tokens` the grammar takes from here (up to the first it refuses,
        or through eos), and the allowed set before each of those and after the last:
        bool [n + 1, V] (after eos: anything, as nothing follows it). The state is left as
        it was."""
        masks = [self.allowed()]
        taken = 0
        for tok in tokens:
            if not masks[-1][tok]:
                break
            if tok in self.eos:
                masks.append(torch.ones(self.vocab_size, dtype=torch.bool))
                break
            self.advance([tok])
            taken += 1
            masks.append(self.allowed())
        self.rollback(taken)
        return len(masks) - 1, torch.stack(masks)
