"""The verify step (runner thread): one forward scores every drafted position, the target's own
sampler picks each position's token, and the drafts it agrees with are kept.

A running sequence of ``n`` tokens (``n - 1`` of them cached) with drafts ``d_0 .. d_(K-1)``
becomes a prompt chunk of ``K + 1`` rows over its cached prefix: its last token, then the
drafts. Row ``j``'s logits are the bits the plain decode step would produce at position
``n - 1 + j`` had ``d_0 .. d_(j-1)`` been sampled (docs/architecture.md, "Numerics"), and row
``j`` is sampled as that step would sample it: a view of the sequence that ends with those drafts
(its position keys the noise; penalties and ``min_tokens`` count the drafts as output). Draft
``d_j`` is accepted iff it equals row ``j``'s token; the first row that disagrees gives the
token the plain stream has there (the bonus), so the run emitted is the plain stream's next
``a + 1`` tokens. The K/V rows written for rejected drafts lie past the sequence's length:
nothing reads them as valid, and the next step overwrites them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.model_runner import ModelRunner
from pdserve.runner_output import RunnerOutput
from pdserve.sampler import sample_step
from pdserve.sequence import Sequence
from pdserve.spec.grammar_rows import FixedMask, draft_masks
from pdserve.types import TokenLogprob


@dataclass
class VerifyOutput(RunnerOutput):
    """A verify step's result: per sequence, the run of tokens to emit (``runs[i]``, at least
    one) and their logprobs (None where the request asked none), and what was drafted."""

    runs: list[list[int]] = field(default_factory=list)
    run_logprobs: list[list[TokenLogprob | None] | None] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0  # the verify forward and its sampling
    step_seconds: float = 0.0  # the whole step, drafting included (set by the speculator)


def accepted_length(drafts: list[int], targets: list[int]) -> int:
    """How many leading drafts equal the target's tokens (``targets`` has one more row)."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a


def row_view(seq: Sequence, drafts: list[int], mask: FixedMask | None = None) -> Sequence:
    """``seq`` as if ``drafts`` had been sampled: what the plain step at that position sees
    (``mask``: its grammar's mask there, pdserve.spec.grammar_rows)."""
    view = Sequence(
        seq.seq_id, seq.token_ids + drafts, seq.num_prompt_tokens, seq.sampling, seq.page_ids,
        seq.num_cached_tokens,
    )  # fmt: skip
    view.grammar = mask  # type: ignore[assignment]  # the sampler only asks it for its bitmask
    return view


def verify(runner: ModelRunner, seqs: list[Sequence], drafts: list[list[int]]) -> VerifyOutput:
    """One forward of every sequence's last token and its drafts (``drafts[i]`` may be empty:
    a plain row); the accepted runs. Pages for ``n + len(drafts[i])`` tokens must be held."""
    t0 = time.perf_counter()
    masks: list[list[FixedMask]] = []
    for i, (s, d) in enumerate(zip(seqs, drafts, strict=True)):
        if s.grammar is not None and d:
            drafts[i], m = draft_masks(s.grammar, d)
            masks.append(m)
        else:
            masks.append([])
    chunks = [row_view(s, d) if d else s for s, d in zip(seqs, drafts, strict=True)]
    logits, kv_ready = runner.extend_logits(chunks)
    rows: list[Sequence] = []
    for s, d, m in zip(seqs, drafts, masks, strict=True):
        rows.append(s)  # row 0 is the plain step itself (its grammar, if any, applies)
        rows += [row_view(s, d[:j], m[j - 1] if m else None) for j in range(1, len(d) + 1)]
    token_ids, logprobs = sample_step(logits, rows, runner.tokenizer.eos_token_ids, runner.device)
    out = VerifyOutput(token_ids=[], kv_ready=kv_ready, drafts=drafts)
    start = 0
    for d in drafts:
        targets = token_ids[start : start + len(d) + 1]
        a = accepted_length(d, targets)
        out.runs.append(targets[: a + 1])
        out.run_logprobs.append(logprobs[start : start + a + 1] if logprobs else None)
        start += len(d) + 1
    out.token_ids = [r[0] for r in out.runs]
    out.seconds = time.perf_counter() - t0
    return out
