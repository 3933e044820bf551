"""Which requests need the prompt's logits in the reply (prompt scoring): lm-eval's
loglikelihood and multiple-choice tasks send ``echo`` with ``logprobs`` (or ``max_tokens: 0``
with ``echo``), vLLM clients ``prompt_logprobs``. A PD pair cannot answer them (the logits stay
on the prefill), so the router serves them on one worker that prefills them itself."""

from __future__ import annotations

from typing import Any


def needs_prompt_logits(path: str, body: dict[str, Any]) -> bool:
    """Whether the request asks for its prompt's logprobs."""
    if body.get("prompt_logprobs") is not None:
        return True
    if not path.endswith("/completions") or path.endswith("/chat/completions"):
        return False
    if body.get("echo") is not True:
        return False
    return body.get("logprobs") is not None or body.get("max_tokens") == 0
