"""Speculative decoding's configuration (``--speculative-method``, ``--num-speculative-tokens``)."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: ``ngram`` (prompt lookup: drafts from the request's own tokens) or ``draft``
    (a smaller model of the same tokenizer, ``draft_model``). ``num_speculative_tokens``: the
    most tokens drafted per request and step. ``prompt_lookup_min/max``: vLLM's n-gram sizes
    (the longest suffix n-gram between them found earlier in the request's tokens wins).
    ``disable_batch_size``: a decode batch of more requests than this verifies nothing (on a
    CPU a K-row verify costs about K decode rows once the batch is compute-bound). ``adaptive``:
    below that, speculate only at batch sizes where it measured faster than plain steps."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    draft_model: str | None = None
    disable_batch_size: int = 4
    # Measure whether speculating pays per batch size and step aside where it does not
    # (pdserve.spec.payoff); False: speculate whenever there are drafts.
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs a draft model")
        if self.disable_batch_size < 1:
            raise ValueError("speculative disable_batch_size must be >= 1")
