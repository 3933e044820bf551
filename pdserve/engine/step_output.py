"""The engine's step results: run a step's forward, then commit its tokens to their requests.

The engine loop submits :meth:`StepOutputs.run` to the runner thread and, on the loop, hands its
result to :meth:`StepOutputs.apply`. Deltas of requests that go on are deferred and emitted while
the next step computes (:meth:`StepOutputs.emit_deferred`); a step's constrained rows have their
next grammar masks filled meanwhile (pdserve.grammar.filler). It sees of the engine only the
runner, the scheduler and :class:`StepHooks` (emit, fail, disarm, the hand-off).
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Protocol

from pdserve.engine.config import EngineConfig
from pdserve.engine.handoff import Handoff
from pdserve.engine.protocol import EngineError, EngineInfo, TokenLogprob
from pdserve.engine.request import Request, RequestState
from pdserve.engine.scheduler import Batch, Scheduler
from pdserve.grammar.matcher import prefetch_all
from pdserve.kernels.kv_cache import PageAllocator
from pdserve.kernels.kv_ready import KVReady
from pdserve.kernels.prompt_logprobs import PromptLogprobs
from pdserve.model_runner import ModelRunner
from pdserve.reasoning.gate import grammar_sees
from pdserve.runner_output import RunnerOutput
from pdserve.sequence import Sequence
from pdserve.spec.build import speculator_for
from pdserve.spec.speculator import Speculator
from pdserve.spec.verify import VerifyOutput

logger = logging.getLogger(__name__)


class StepOutput(NamedTuple):
    """A step's results, split by row kind; ``kv_ready`` marks its one forward's KV writes."""

    decode: RunnerOutput | None
    prefill: RunnerOutput | None
    kv_ready: KVReady


class StepHooks(Protocol):
    """What a step's commit calls back in the engine."""

    handoff: Handoff | None  # attached after the engine was built
    config: EngineConfig
    allocator: PageAllocator
    info: EngineInfo

    def emit(self, req: Request, ids: list[int], logprobs: list[TokenLogprob] | None) -> None: ...

    def fail(self, req: Request, error: EngineError) -> None: ...

    def disarm(self, req: Request) -> None: ...

    def free_pages(self, pages: list[int]) -> None: ...


class StepOutputs:
    """Step execution and token commit for one engine (see the module doc)."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, hooks: StepHooks) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.hooks = hooks
        # Deltas of the last step for requests that go on: emitted while the next step computes.
        self._deferred_emits: list[tuple[Request, int, list[TokenLogprob] | None]] = []
        # Decode-only steps may verify drafts (pdserve.spec).
        self.speculator: Speculator | None = speculator_for(
            hooks.config, runner, hooks.allocator, hooks.info.max_model_len
        )

    @property
    def has_deferred(self) -> bool:
        return bool(self._deferred_emits)

    def run(self, seqs: tuple[list[Request], list[Sequence]]) -> StepOutput:
        """Runner thread: one forward for the step. A mixed step's decode rows ride in the
        prompt chunks' forward (:meth:`ModelRunner.mixed`): the weights are read once for both."""
        decode, prefill = seqs
        if not prefill:
            spec = self.speculator
            verified = spec.run(self.runner, decode) if spec is not None else None
            if verified is not None:
                return StepOutput(verified, None, verified.kv_ready)
            out = self.runner.decode([r.seq for r in decode])
            return StepOutput(out, None, out.kv_ready)
        if not decode:
            out = self.runner.prefill(prefill)
            return StepOutput(None, out, out.kv_ready)
        out = self.runner.mixed(prefill, [r.seq for r in decode])
        n, lps, plps = len(prefill), out.logprobs, out.prompt_logprobs
        return StepOutput(
            RunnerOutput(out.token_ids[n:], lps[n:] if lps else None),
            RunnerOutput(out.token_ids[:n], lps[:n] if lps else None,
                         prompt_logprobs=plps[:n] if plps else None),
            out.kv_ready,
        )  # fmt: skip

    def apply(self, batch: Batch, dec: RunnerOutput | None, pre: RunnerOutput | None) -> None:
        """Commit a step's tokens. Requests that end with this token (stop token, length) are
        finished now so the next step leaves them out; the others' deltas are deferred to
        :meth:`emit_deferred`, which runs once the next step is submitted. A prefill row that
        was not its prompt's last chunk only advances its cached count: its sampled token is
        discarded and never reaches the grammar or the client."""
        spec = self.speculator
        if isinstance(dec, VerifyOutput):
            assert spec is not None
            spec.commit(self, batch.decode, dec)
        elif dec is not None:
            self._apply_rows(batch.decode, dec.token_ids, dec.logprobs, None, None)
            if spec is not None:
                # Its time is what speculating must beat; and room for the next step's drafts.
                spec.on_plain_step(self, batch.decode, sum(self.runner.stats.last_step.values()))
        if pre is None:
            return
        done: list[Request] = []
        keep: list[int] = []
        for i, (req, end) in enumerate(zip(batch.prefill, batch.prefill_ends, strict=True)):
            if not req.is_finished and self.scheduler.prefilled(req, end):
                done.append(req)
                keep.append(i)
        if done:
            lps, plps = pre.logprobs, pre.prompt_logprobs
            self._apply_rows(
                done, [pre.token_ids[i] for i in keep], [lps[i] for i in keep] if lps else None,
                [plps[i] for i in keep] if plps else None, pre.kv_ready,
            )  # fmt: skip

    def _apply_rows(
        self,
        reqs: list[Request],
        token_ids: list[int],
        logprobs: list[TokenLogprob | None] | None,
        prompt_logprobs: list[PromptLogprobs | None] | None,
        kv_ready: KVReady | None,
    ) -> None:
        """Commit one token per request: prefill rows (their last chunk) carry the step's
        ``kv_ready`` marker for the hand-off; decode rows pass None."""
        deferred = self._deferred_emits
        none = [None] * len(reqs)
        constrained: list[Request] = []  # their next masks are filled during the next step
        for req, tok, lp, plp in zip(
            reqs, token_ids, logprobs or none, prompt_logprobs or none, strict=True
        ):
            if req.is_finished:
                continue  # aborted, failed or stopped (stop string) while the step ran
            if plp is not None:
                req.prompt_logprobs = plp  # goes out with the first delta
            seq = req.seq
            seq.num_cached_tokens = seq.num_tokens
            seq.token_ids.append(tok)
            is_fed = grammar_sees(seq, tok)  # False inside a thinking block and at its end
            if is_fed and seq.grammar is not None and not self.advance_grammar(req, tok):
                continue
            if kv_ready is not None:  # a prefill row
                handoff = self.hooks.handoff
                if handoff is not None and handoff.on_prefilled(req, tok, lp, kv_ready):
                    continue
                if req.state is RequestState.PREFILLING:
                    req.move(RequestState.RUNNING, "prefilled")
                    self.hooks.disarm(req)
                    self.scheduler.add_running(req)
            if seq.grammar is not None:
                constrained.append(req)
            lps = [lp] if lp is not None else None
            if req.out_state.is_final(tok):
                self.hooks.emit(req, [tok], lps)
            else:
                deferred.append((req, tok, lps))
        if constrained:  # one hand-off to the filler thread for the step's rows
            prefetch_all([r.seq.grammar for r in constrained if not r.is_finished])

    def commit_run(
        self, req: Request, run: list[int], logprobs: list[TokenLogprob | None] | None
    ) -> None:
        """Commit a verify step's run for one decode row, token by token as plain steps would:
        the first token that ends the request (stop id, length, grammar end) ends the run
        there and the rest is dropped; the run goes out at once then, else deferred."""
        seq = req.seq
        pending: list[tuple[Request, int, list[TokenLogprob] | None]] = []
        for i, tok in enumerate(run):
            seq.num_cached_tokens = seq.num_tokens
            seq.token_ids.append(tok)
            is_fed = grammar_sees(seq, tok)
            if is_fed and seq.grammar is not None and not self.advance_grammar(req, tok):
                return
            lp = logprobs[i] if logprobs else None
            pending.append((req, tok, [lp] if lp is not None else None))
            if req.out_state.is_final(tok):
                for _, t, lps in pending:
                    if not req.is_finished:
                        self.hooks.emit(req, [t], lps)
                return
        if seq.grammar is not None:
            prefetch_all([seq.grammar])
        self._deferred_emits += pending

    def free_pages(self, pages: list[int]) -> None:
        self.hooks.free_pages(pages)

    def advance_grammar(self, req: Request, token: int) -> bool:
        """Move the request's matcher past ``token``; a rejected token fails the request (the
        mask allowed it, so the matcher is in error: out of its parser limits)."""
        grammar = req.seq.grammar
        assert grammar is not None
        if grammar.accept(token):
            return True
        reason = grammar.error or f"token {token} rejected"
        logger.info("req=%s grammar failed: %s", req.request_id, reason)
        self.hooks.fail(
            req, EngineError(f"structured output failed: {reason}", 500, "internal_error")
        )
        return False

    def emit_deferred(self) -> None:
        if not self._deferred_emits:
            return
        items, self._deferred_emits = self._deferred_emits, []
        for req, tok, lps in items:
            if not req.is_finished:  # an abort or deadline may have ended it since
                self.hooks.emit(req, [tok], lps)
