"""The router's internal migration fields: ``return_token_ids`` (each streamed chunk names the
token ids it carries, so the router knows exactly what reached the client) and
``resume_params`` (continue a request another worker was streaming when it died).

Both are harmless from any other client: the first only adds a field to chunks, the second
asks for a continuation of text the client says it already has.
"""

from __future__ import annotations

from typing import Any

from pdserve.api.errors import bad_request, unrecognized_argument
from pdserve.api.validation import as_int, as_list, as_object, require
from pdserve.engine.protocol import ResumeState

RESUME_FIELDS = frozenset({"return_token_ids", "resume_params"})


def parse_resume(value: Any, vocab_size: int) -> ResumeState | None:
    """``resume_params``: ``{"token_ids": [generated ids], "num_text_chars": int}``."""
    if value is None:
        return None
    obj = as_object(value, "resume_params")
    for key in obj:
        if key not in ("token_ids", "num_text_chars"):
            raise unrecognized_argument(f"resume_params.{key}")
    items = as_list(require(obj, "token_ids", "resume_params.token_ids"), "resume_params.token_ids")
    ids = tuple(
        as_int(v, f"resume_params.token_ids[{i}]", 0, vocab_size - 1) for i, v in enumerate(items)
    )
    num_chars = as_int(obj.get("num_text_chars", 0), "resume_params.num_text_chars", 0)
    return ResumeState(ids, num_chars)


def check_resume_budget(resume: ResumeState | None, budget: int, num_choices: int) -> None:
    """A resumed request is one choice that still has tokens left to generate."""
    if resume is None:
        return
    if num_choices != 1:
        raise bad_request(
            "'resume_params' needs a single choice (n=1, one prompt).", param="resume_params"
        )
    if len(resume.token_ids) >= budget:
        raise bad_request(
            f"'resume_params.token_ids' holds {len(resume.token_ids)} tokens, no fewer than the "
            f"{budget} this request may generate: nothing is left to resume.",
            param="resume_params.token_ids",
        )
