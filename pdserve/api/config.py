"""Configuration of a worker's OpenAI-compatible HTTP layer."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1024 * 1024


@dataclass(frozen=True)
class ApiConfig:
    """Limits and identity of the HTTP API; built by the server from its CLI flags.

    ``request_deadline_s`` is handed to the engine as each request's overall deadline; the HTTP
    layer also enforces it (plus ``deadline_grace_s``) as a backstop so no client waits forever.
    """

    served_model_name: str
    # Clients' keys: one, or a tuple (each its own owner of the requests it starts).
    api_key: str | tuple[str, ...] | None = None
    admin_api_key: str | None = None  # /debug/*, /drain, any abort, /metrics (pdserve/auth.py)
    metrics_open: bool = False  # /metrics without the admin key
    max_body_bytes: int = 4 * MiB
    max_n: int = 16  # choices per HTTP request (n x number of prompts)
    max_stop_strings: int = 16
    max_stop_len: int = 256
    max_top_logprobs: int = 20
    default_max_tokens: int = 256
    request_deadline_s: float | None = None
    deadline_grace_s: float = 2.0
    body_read_timeout_s: float = 30.0  # a client trickling its body must not hold a handler
    write_timeout_s: float = 30.0  # a client that stops reading its stream counts as gone
    # A stream whose first token takes longer gets ": keep-alive" comments this often (0: off).
    sse_keepalive_s: float = 15.0
    abort_timeout_s: float = 5.0  # bound on engine.abort() during cleanup
    max_inline_tokenize_chars: int = 32_768  # longer prompts are tokenized off the event loop
    max_grammar_chars: int = 65_536  # a JSON schema / regex / grammar / choice list, as text
    max_logit_bias: int = 300  # entries in logit_bias (OpenAI's limit)
    max_tools: int = 128
    # JSON schemas: may objects hold keys their schema does not declare when it says nothing
    # of additionalProperties? False: no (vLLM's default); True: yes (JSON Schema's reading).
    json_allow_extra_keys: bool = False
    # --reasoning-parser (qwen3, deepseek_r1): thinking text goes to reasoning_content.
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.sse_keepalive_s < 0:
            raise ValueError(f"sse_keepalive_s must be >= 0 (0: off), got {self.sse_keepalive_s}")

    # --tool-call-parser: a name of pdserve.api.tool_parsers.CHOICES ("auto": from the template).
    tool_call_parser: str = "auto"
