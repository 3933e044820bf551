"""Per-request sampling and stopping parameters (validated once, at the API edge)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0  # keep tokens with p >= min_p * max p (after temperature); 0 disables
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids are impossible before this many tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs, with this many top
    skip_special_tokens: bool = True  # detokenization: leave special tokens out of the text
    include_stop_str_in_output: bool = False  # a matched stop string stays in the text
    # Prefix-cache isolation between tenants: pages are found again only by requests with the
    # same salt (it seeds the chain of page keys). Not a sampling knob, but per request.
    cache_salt: str | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1
