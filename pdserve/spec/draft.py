"""Draft-model proposals: a small model of the same tokenizer drafts K tokens per request.

The draft runs in the worker's runner thread with its own :class:`ModelRunner`, page pool,
allocator and prefix cache (a request's full pages are keyed when it ends, so a prompt seen
before, a chat's earlier turns or a shared system prompt, is not prefilled in the draft again).
Each request's draft sequence follows the target's tokens: what the target accepted is already
in the draft's KV (the draft computed those very tokens), what it rejected is dropped by
lowering the draft's cached count to the common prefix (pages stay, their stale rows lie past
the length). A request new to the draft (a new stream; on a PD decode worker, the prompt whose
target KV came by transfer) is prefilled in the draft from its tokens: for a draft ~3x smaller
than the target, a prompt costs a third of the target's prefill, on the decode worker, once.

The draft samples with the request's own parameters and seed, at the same positions: the same
noise as the target's sampler (a shared random source), which is what makes a seeded draft agree
with the target where their distributions are close. K adapts per request: the ceiling
``num_speculative_tokens``, lowered to its recent accepted run length plus one.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from pdserve.engine.prefix_cache import PrefixCache
from pdserve.kernels.kv_cache import PageAllocator
from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.sequence import Sequence
from pdserve.spec.config import SpeculativeConfig

logger = logging.getLogger(__name__)

# Weight of a request's latest verify in its accepted-length average (adaptive K).
_EMA = 0.5


@dataclass
class _DraftSeq:
    seq: Sequence  # the draft's view: token ids it holds, its pages, its cached count
    synced: int  # leading tokens known equal to the target's
    mean_accepted: float
    last_drafts: list[int]
    page_keys: list[bytes]  # its prefix-cache keys (pdserve.engine.prefix_cache)


class DraftProposer:
    """Proposes with a draft :class:`ModelRunner` (built on first use, on the runner thread)."""

    def __init__(
        self, config: SpeculativeConfig, target: ModelRunner, runner: ModelRunner | None = None
    ) -> None:
        assert config.draft_model
        self.config = config
        self._target_cfg = target.config
        self._max_len = target.max_model_len
        self.runner = runner
        self.allocator: PageAllocator | None = None
        self.cache: PrefixCache | None = None
        self._seqs: dict[str, _DraftSeq] = {}

    def _ensure_runner(self) -> ModelRunner:
        if self.runner is None:
            t = self._target_cfg
            self.runner = ModelRunner(
                RunnerConfig(
                    model_dir=str(self.config.draft_model), page_size=t.page_size,
                    kv_cache_bytes=t.kv_cache_bytes, num_pages=t.num_pages,
                    max_num_seqs=t.max_num_seqs, max_prefill_tokens=t.max_prefill_tokens,
                    max_model_len=self._max_len, device=t.device, num_threads=t.num_threads,
                )
            )  # fmt: skip
            logger.info("draft model %s loaded", self.config.draft_model)
        if self.allocator is None:
            self.allocator = PageAllocator(self.runner.kv_config.num_pages)
            self.cache = PrefixCache(self.allocator, self.runner.kv_config.page_size)
        return self.runner

    @property
    def num_held(self) -> int:
        return len(self._seqs)

    def release(self, seq_id: str) -> None:
        state = self._seqs.pop(seq_id, None)
        if state is not None and self.allocator is not None and self.cache is not None:
            # Its full pages below the cached count hold the KV of their keyed tokens.
            self.cache.register(state.seq, state.page_keys)
            self.allocator.free(state.seq.page_ids)

    def _state(self, seq: Sequence, k: int) -> _DraftSeq | None:
        """The draft's sequence for ``seq``, in step with its tokens, with pages for ``k`` more."""
        assert self.allocator is not None and self.cache is not None
        ps = self.cache.page_size
        st = self._seqs.get(seq.seq_id)
        if st is None:
            sp = dataclasses.replace(seq.sampling, logprobs=False, top_logprobs=0)
            view = Sequence(seq.seq_id, list(seq.token_ids), seq.num_prompt_tokens, sp)
            keys: list[bytes] = []
            hit = self.cache.lookup(view, keys)  # leaves one token at least to compute
            missing = -(-(view.num_tokens + k) // ps) - len(hit)
            if not self.cache.can_allocate_with(hit, missing):
                return None
            self.cache.acquire(view, hit)  # cached: the hit's tokens, never written again
            view.page_ids.extend(self.allocator.allocate(missing))
            st = self._seqs[seq.seq_id] = _DraftSeq(view, seq.num_tokens - 1, float(k), [], keys)
            return st
        # How far its last drafts were accepted: the target's tokens after ``synced``.
        drafted, target = st.last_drafts, seq.token_ids
        base = st.synced + 1  # the first draft stood for the token after the synced ones
        a = 0
        while a < len(drafted) and base + a < len(target) and target[base + a] == drafted[a]:
            a += 1
        st.mean_accepted = (1 - _EMA) * st.mean_accepted + _EMA * a
        d = st.seq
        common = min(st.synced, d.num_cached_tokens)
        while common < min(len(d.token_ids), len(seq.token_ids), d.num_cached_tokens) and (
            d.token_ids[common] == seq.token_ids[common]
        ):
            common += 1
        d.token_ids = list(seq.token_ids)
        d.num_cached_tokens = min(d.num_cached_tokens, common, len(d.token_ids) - 1)
        st.synced = len(seq.token_ids) - 1
        missing = -(-(len(d.token_ids) + k) // ps) - len(d.page_ids)
        if missing > 0:
            if not self.allocator.can_allocate(missing):
                self.release(seq.seq_id)
                return None
            d.page_ids.extend(self.allocator.allocate(missing))
        return st

    def k_for(self, seq_id: str, ceiling: int) -> int:
        st = self._seqs.get(seq_id)
        if st is None:
            return ceiling
        return max(1, min(ceiling, int(st.mean_accepted + 1.999)))

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        runner = self._ensure_runner()
        out: list[list[int]] = [[] for _ in seqs]
        live: list[tuple[int, _DraftSeq, int]] = []
        for i, (s, k) in enumerate(zip(seqs, ks, strict=True)):
            if k:
                k = min(k, self.k_for(s.seq_id, k))
                st = self._state(s, k)
                if st is not None:
                    live.append((i, st, k))
        if not live:
            return out
        # One forward catches every draft sequence up (its uncached tokens, at least the last)
        # and samples each first draft; then one decode step per further draft.
        first = runner.prefill([st.seq for _, st, _ in live]).token_ids
        for (i, _st, _), tok in zip(live, first, strict=True):
            out[i].append(tok)
        step = 1
        while True:
            rows = [(i, st) for i, st, k in live if k > step]
            if not rows:
                break
            for i, st in rows:
                d = st.seq
                d.num_cached_tokens = d.num_tokens
                d.token_ids.append(out[i][-1])
            toks = runner.decode([st.seq for _, st in rows]).token_ids
            for (i, _), tok in zip(rows, toks, strict=True):
                out[i].append(tok)
            step += 1
        for i, st, _ in live:
            # The draft KV holds its prompt and every draft but the last: cached up to there.
            d = st.seq
            d.num_cached_tokens = d.num_tokens
            d.token_ids.append(out[i][-1])
            st.last_drafts = out[i]
        return out
