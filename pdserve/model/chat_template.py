"""Render Hugging Face chat templates (jinja2, sandboxed, with the helpers templates expect)."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template is missing, malformed, or rejected the conversation."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    # transformers' tojson keeps non-ASCII text as is (jinja's default escapes it).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str] | None = None,
    **extra: Any,
) -> str:
    """Render ``source`` with the variables transformers passes (messages, bos/eos tokens, ...)."""
    try:
        template = _compile(source)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **(special_tokens or {}),
            **extra,
        )
    except TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e
