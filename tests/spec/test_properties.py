"""A hypothesis property: whatever the prompts, K, method and batch mates, speculation gives
each request the plain stream's tokens, logprobs and text."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.model_runner import ModelRunner
from pdserve.spec.config import SpeculativeConfig

from .harness import both, greedy, seeded

PIECES = ["def main(argv):\n", "    return 0\n", "class Page:\n", "    pass\n", "x = 1\n", "# "]


@st.composite
def requests(draw: st.DrawFn) -> list[tuple[list[int], int | None, int]]:
    """(text piece indices, seed or None for greedy, max_tokens) per request."""
    n = draw(st.integers(1, 4))
    return [
        (
            draw(st.lists(st.integers(0, len(PIECES) - 1), min_size=1, max_size=8)),
            draw(st.one_of(st.none(), st.integers(0, 1000))),
            draw(st.integers(1, 14)),
        )
        for _ in range(n)
    ]


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    reqs=requests(),
    k=st.integers(1, 5),
    method=st.sampled_from(["ngram", "draft", "self"]),
    budget=st.sampled_from([5, 2048]),
    adaptive=st.booleans(),
)
def test_speculation_never_changes_a_stream(
    target: ModelRunner,
    draft_dir: Path,
    demo_dir: Path,
    reqs,
    k: int,
    method: str,
    budget: int,
    adaptive: bool,
) -> None:
    model = {"ngram": None, "draft": str(draft_dir), "self": str(demo_dir)}[method]
    spec = SpeculativeConfig(
        "ngram" if method == "ngram" else "draft", num_speculative_tokens=k, prompt_lookup_min=1,
        prompt_lookup_max=3, draft_model=model, disable_batch_size=8, adaptive=adaptive,
    )  # fmt: skip
    tok = target.tokenizer
    batch = []
    for pieces, seed, n in reqs:
        ids = tok.encode("".join(PIECES[i] for i in pieces) * 2)
        sp = greedy(n, ignore_eos=True) if seed is None else seeded(n, seed, ignore_eos=True)
        batch.append((ids, sp))
    plain, seen, _ = both(target, batch, spec, budget=budget)
    assert seen == plain
