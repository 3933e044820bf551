"""The engine's speculation seam: which requests draft, their pages, the verify, the commit.

:meth:`Speculator.run` runs on the runner thread in place of a decode-only step: each eligible
request drafts up to ``num_speculative_tokens`` (fewer where its pages, ``max_tokens`` or the
model window leave less room), and one verify forward (pdserve.spec.verify) scores them all;
with nothing drafted the step stays a plain decode step. On the loop, :meth:`commit` hands each
request's run to the step commit, one token at a time as plain steps would (a stop token, a
length end or a stop string inside the run ends the stream where the plain stream ends), then
fits the request's pages to its length plus the next step's drafts: pages past that are freed,
the next step's are taken from free pages only (never evicting a cached prefix).

Structured outputs draft too: each verify row gets its grammar mask from the matcher advanced
through the drafts and rolled back (pdserve.spec.grammar_rows). Reasoning requests never draft
(the thinking gate changes their logits and their grammar's wakening per token); they still
ride in the verify forward as one-row chunks.
A decode batch of more than ``disable_batch_size`` requests does not speculate.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

from pdserve.engine.request import Request
from pdserve.kernels.kv_cache import PageAllocator
from pdserve.model_runner import ModelRunner
from pdserve.spec.config import SpeculativeConfig
from pdserve.spec.payoff import PayoffPolicy
from pdserve.spec.proposer import Proposer
from pdserve.spec.stats import SpecStats
from pdserve.spec.verify import VerifyOutput, verify

if TYPE_CHECKING:
    from pdserve.types import TokenLogprob

logger = logging.getLogger(__name__)


class RunCommitter(Protocol):
    """The step commit's side of a verify (pdserve.engine.step_output.StepOutputs)."""

    def commit_run(
        self, req: Request, run: list[int], logprobs: list[TokenLogprob | None] | None
    ) -> None: ...

    def free_pages(self, pages: list[int]) -> None: ...


def may_draft(req: Request) -> bool:
    return req.seq.reasoning is None


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        allocator: PageAllocator,
        page_size: int,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.proposer = proposer
        self.allocator = allocator
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.stats = SpecStats(config.num_speculative_tokens)
        # Runner thread: requests the proposer may hold state for (released once they end).
        self._live: dict[str, Request] = {}
        self.payoff = PayoffPolicy() if config.adaptive else None
        self.failed: str | None = None  # the proposer raised: plain steps from then on

    def _room(self, req: Request, k: int) -> int:
        """Drafts ``req`` may verify now: within its pages, ``max_tokens`` and the window."""
        if not may_draft(req):
            return 0
        seq = req.seq
        n = seq.num_tokens
        room = len(seq.page_ids) * self.page_size - n
        left = seq.sampling.max_tokens - seq.num_generated - 1  # the run's last is the target's
        return max(0, min(k, room, left, self.max_model_len - n))

    def wants(self, num_rows: int) -> bool:
        return num_rows <= self.config.disable_batch_size

    # ---- runner thread ---------------------------------------------------------------------
    def run(self, runner: ModelRunner, decode: list[Request]) -> VerifyOutput | None:
        """The verify step for ``decode``, or None for a plain decode step (nothing drafted)."""
        for seq_id, req in list(self._live.items()):  # what the proposer holds for ended ones
            if req.is_finished:
                del self._live[seq_id]
                self.proposer.release(seq_id)
        if self.failed is not None or not self.wants(len(decode)):
            return None
        if self.payoff is not None and not self.payoff.should_speculate(len(decode)):
            return None
        t0 = time.perf_counter()
        k = self.config.num_speculative_tokens
        ks = [self._room(r, k) for r in decode]
        if not any(ks):
            return None
        seqs = [r.seq for r in decode]
        self._live.update((r.seq.seq_id, r) for r, k in zip(decode, ks, strict=True) if k)
        try:
            drafts = self.proposer.propose(seqs, ks)
        except Exception as e:  # a broken draft never fails a request: serve without it
            logger.exception("speculation off: the proposer failed")
            self.failed = f"{type(e).__name__}: {e}"
            return None
        if not any(drafts):
            return None
        out = verify(runner, seqs, drafts)
        out.step_seconds = time.perf_counter() - t0  # drafting included
        return out

    # ---- event loop ------------------------------------------------------------------------
    def commit(self, steps: RunCommitter, decode: list[Request], out: VerifyOutput) -> None:
        st = self.stats
        st.verify_steps += 1
        st.verify_seconds += out.seconds
        for req, run, lps, drafts in zip(
            decode, out.runs, out.run_logprobs, out.drafts, strict=True
        ):
            st.record(len(drafts), len(run))
            if req.is_finished:
                continue  # aborted while the step ran: its pages go with it
            steps.commit_run(req, run, lps)
        if self.payoff is not None:
            self.payoff.on_spec(len(decode), out.step_seconds, sum(map(len, out.runs)))
        self.fit_pages(steps, decode)

    def on_plain_step(self, steps: RunCommitter, decode: list[Request], seconds: float) -> None:
        """A plain decode step of ``decode`` took ``seconds``: what speculating must beat."""
        if self.payoff is not None:
            self.payoff.on_plain(len(decode), seconds)
        self.fit_pages(steps, decode)

    def fit_pages(self, steps: RunCommitter, decode: list[Request]) -> None:
        """Each running request holds pages for its tokens and its next step's drafts."""
        k = self.config.num_speculative_tokens if self.wants(len(decode)) else 0
        alloc, ps = self.allocator, self.page_size
        for req in decode:
            if req.is_finished:
                continue
            seq = req.seq
            drafts = min(k, self.max_model_len - seq.num_tokens) if may_draft(req) else 0
            need = -(-(seq.num_tokens + drafts) // ps)
            have = len(seq.page_ids)
            if have > need:
                extra = seq.page_ids[need:]
                del seq.page_ids[need:]
                steps.free_pages(extra)  # never keyed: they lie past the cached tokens
            elif need > have and alloc.num_free >= need - have + len(decode):
                seq.page_ids.extend(alloc.allocate(need - have))
