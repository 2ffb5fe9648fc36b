"""Log-probabilities of the generated tokens (OpenAI's `logprobs`).

They are the model's own: the log-softmax of the logits row that chose each token, before
temperature, top-k, top-p and any grammar (vLLM's default, `raw_logprobs`), so they do not
depend on how the token was picked. Speculative decoding reads them from the verify rows
that accepted the tokens: the same rows, up to float rounding between graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

MAX_TOP = 20  # OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token, its log-probability, and the `top` most likely tokens in its
    position with theirs (most likely first)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(rows: Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """`rows` [n, V]: the logits that chose `tokens` (n of them)."""
    logp = rows[: len(tokens)].float().log_softmax(-1)
    chosen = logp[range(len(tokens)), tokens].tolist()
    if top:
        best = logp.topk(top, dim=-1)
        alternatives = [
            list(zip(i, v, strict=True))
            for i, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)
        ]
    else:
        alternatives = [[] for _ in tokens]
    return [
        TokenLogprob(t, lp, alt) for t, lp, alt in zip(tokens, chosen, alternatives, strict=True)
    ]
