"""Turns sampled tokens into streamed deltas: detokenization, stop checks, stop-string hold-back."""

from __future__ import annotations

from pdserve.engine.protocol import GenerateOutput, ResumeState, TokenLogprob
from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.sequence import Sequence


class OutputState:
    """Per-request output bookkeeping, driven once per new token batch on the event loop."""

    def __init__(
        self, request_id: str, seq: Sequence, tokenizer: Tokenizer, max_model_len: int
    ) -> None:
        self.request_id = request_id
        self.seq = seq
        self.max_model_len = max_model_len
        sp = seq.sampling
        self._stop_ids = frozenset(sp.stop_token_ids) | (
            frozenset() if sp.ignore_eos else tokenizer.eos_token_ids
        )
        self._stops = [s for s in sp.stop if s]
        # Text that might be the start of a stop string is held back until it can't be.
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._detok = IncrementalDetokenizer(
            tokenizer, seq.token_ids[: seq.num_prompt_tokens], sp.skip_special_tokens
        )
        self._keep_stop_str = sp.include_stop_str_in_output
        self._text = ""  # all generated text so far (untrimmed)
        self._num_sent_chars = 0
        self._num_sent_tokens = 0

    def replay(self, token: int, resume: ResumeState | None) -> None:
        """A migrated request's replayed token (already appended): another worker streamed
        it, so it is only accounted for. Of the text so far, the client has the first
        ``resume.num_text_chars`` characters: text that worker still held back (a possible
        stop string, half a character) goes out with the next delta, nothing twice."""
        if token not in self._stop_ids:
            self._text += self._detok.step([token])
        self._num_sent_tokens += 1
        num_chars = resume.num_text_chars if resume is not None else len(self._text)
        self._num_sent_chars = min(num_chars, len(self._text))

    def is_final(self, last_token: int) -> bool:
        """Does the sequence end with ``last_token`` (already appended) by a token-level rule?

        Stop strings need the text and are found by :meth:`update`; every other ending is known
        here, before detokenizing, so the engine can leave the sequence out of the next step.
        """
        return last_token in self._stop_ids or self._is_grammar_end() or self._is_length_end()

    def _is_grammar_end(self) -> bool:
        # The structured output is complete: nothing but EOS could follow.
        grammar = self.seq.grammar
        return grammar is not None and grammar.is_done

    def _is_length_end(self, num_generated: int | None = None) -> bool:
        """``num_generated``: the count at the end of the delta being built (a speculative
        run's later tokens may already be in the sequence); None: the sequence's."""
        seq = self.seq
        n = seq.num_generated if num_generated is None else num_generated
        return n >= seq.sampling.max_tokens or seq.num_prompt_tokens + n >= self.max_model_len

    def update(
        self, new_ids: list[int], logprobs: list[TokenLogprob] | None = None
    ) -> GenerateOutput:
        """Account for tokens already appended to the sequence; returns the delta to stream."""
        finish, stop_reason = None, None
        for i, tok in enumerate(new_ids):
            if tok in self._stop_ids:
                finish, stop_reason = "stop", tok
                new_ids = new_ids[: i + 1]
                break
        text_ids = [t for t in new_ids if t not in self._stop_ids]
        prev_len = len(self._text)
        self._text += self._detok.step(text_ids) if text_ids else ""
        if finish is None and self._is_grammar_end():
            finish = "stop"
        if finish is None and self._is_length_end(self._num_sent_tokens + len(new_ids)):
            finish = "length"
        if finish is not None:
            self._text += self._detok.flush()  # the end of the stream: nothing more to wait for
        end = len(self._text)
        if self._stops:
            hit = self._find_stop(prev_len)
            if hit is not None:
                end, stop_reason, finish = hit[0], hit[1], "stop"
                if self._keep_stop_str:
                    end += len(hit[1])
        if finish is None:
            end = max(self._num_sent_chars, end - self._hold)
        delta = self._text[self._num_sent_chars : end]
        self._num_sent_chars = end
        self._num_sent_tokens += len(new_ids)
        return GenerateOutput(
            request_id=self.request_id,
            token_ids=list(new_ids),
            text=delta,
            num_prompt_tokens=self.seq.num_prompt_tokens,
            num_generated_tokens=self._num_sent_tokens,
            finish_reason=finish,
            logprobs=logprobs[: len(new_ids)] if logprobs else None,
            stop_reason=stop_reason,
        )

    def _find_stop(self, prev_len: int) -> tuple[int, str] | None:
        start = max(0, prev_len - self._hold)
        best: tuple[int, str] | None = None
        for s in self._stops:
            pos = self._text.find(s, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        return best
