"""Chat template rendering: transformers' helpers and failures as ChatTemplateError."""

from __future__ import annotations

import pytest

from pdserve.model.chat_template import ChatTemplateError, render_chat_template


def test_template_sees_special_tokens_and_generation_flag() -> None:
    src = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    src += "{% if add_generation_prompt %}[assistant]{% endif %}"
    out = render_chat_template(src, [{"role": "user", "content": "hi"}], True, {"bos_token": "<s>"})
    assert out == "<s>[user]hi[assistant]"


def test_tojson_keeps_non_ascii_and_raise_exception_becomes_template_error() -> None:
    src = "{{ messages[0] | tojson }}"
    assert render_chat_template(src, [{"content": "é"}]) == '{"content": "é"}'
    bad = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="first must be user"):
        render_chat_template(bad, [{"role": "assistant", "content": ""}])


def test_template_cannot_reach_python_internals() -> None:
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages.__class__.__mro__[1].__subclasses__() }}", [])
