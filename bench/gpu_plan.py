"""The GPU check's plan: what each step does (its sizes) and how long it may take (its budget).

A device machine is lent for 15 minutes in all, one command at most 10: the check must end within
:data:`TOTAL_LIMIT_S` (8 minutes) on its first try. Each step has a budget; the budgets add up to
less than the limit (the rest is the margin: the interpreter's start, the JSON writes), and
``python bench/gpu_check.py --dry-plan`` prints them and fails when they do not fit, before any
device time is spent. While the check runs, a step whose budget no longer fits in what is left
of the limit is skipped (and recorded so), steps run in subprocesses are killed at their budget,
and an in-process step that overran is recorded as such.

The budgets are limits chosen from the steps' sizes, not timings: no GPU has run this check yet.
"""

from __future__ import annotations

from dataclasses import dataclass

TOTAL_LIMIT_S = 480.0  # 8 minutes: the device call's own limit is 600 s
MARGIN_S = 45.0  # what the budgets leave of the limit, at least

# The order the steps run in: the measured figures first (each one self-contained, seconds to
# a minute), then the multi-process steps whose start-up cost is the least predictable.
STEP_ORDER = ("checkpoint", "bandwidth", "decode_speed", "chunked_prefill", "hf_generate",
              "device_tests", "pd_vs_colocated", "readiness")  # fmt: skip


@dataclass(frozen=True)
class Sizes:
    """How much each step does: the full run, or ``--quick``'s rehearsal."""

    batches: tuple[int, ...]
    concurrencies: tuple[int, ...]
    context: int
    decode_steps: int
    greedy_tokens: int
    serving_input: int
    serving_output: int
    copy_bytes: int
    long_prompt: int  # chunked_prefill: the prompt, in chunks of `chunk` beside 8 decode rows
    chunk: int
    budgets_s: tuple[tuple[str, float], ...]  # (step, seconds) for every step of STEP_ORDER
    total_limit_s: float

    def budget(self, step: str) -> float:
        return dict(self.budgets_s)[step]

    @property
    def total_budget_s(self) -> float:
        return sum(s for _, s in self.budgets_s)


FULL = Sizes(
    batches=(1, 8, 64), concurrencies=(1, 16, 64), context=128, decode_steps=20,
    greedy_tokens=32, serving_input=128, serving_output=128, copy_bytes=2 << 30,
    long_prompt=4096, chunk=512,
    budgets_s=(
        ("checkpoint", 45.0),  # ~1.1B random bf16 weights and a 32k BPE tokenizer, on the host
        ("bandwidth", 10.0),
        ("decode_speed", 40.0),  # load, KV sizing, graph capture of 11 buckets, 3 x 20 steps
        ("chunked_prefill", 30.0),
        ("hf_generate", 40.0),  # eager (disable_compile): 3 batches x 4 generations
        ("device_tests", 100.0),  # kernel, attention, model, runner tests; Triton compiles
        ("pd_vs_colocated", 110.0),  # 3 processes up, greedy + 3 concurrencies; then 1 process
        ("readiness", 45.0),  # VRAM over NIXL: one process, then two
    ),
    total_limit_s=TOTAL_LIMIT_S,
)  # fmt: skip
# The CPU rehearsal: the same steps on the tiny demo model, budgets for a loaded 2-core box.
QUICK = Sizes(
    batches=(1, 4), concurrencies=(1, 4), context=32, decode_steps=4, greedy_tokens=8,
    serving_input=32, serving_output=8, copy_bytes=32 << 20, long_prompt=256, chunk=64,
    budgets_s=(
        ("checkpoint", 60.0), ("bandwidth", 10.0), ("decode_speed", 60.0),
        ("chunked_prefill", 60.0), ("hf_generate", 60.0), ("device_tests", 240.0),
        ("pd_vs_colocated", 300.0), ("readiness", 120.0),
    ),
    total_limit_s=900.0,
)  # fmt: skip


def plan_problems(sizes: Sizes) -> list[str]:
    """What is wrong with a plan: a step without a budget (or one not run), too little margin."""
    problems = []
    named = [name for name, _ in sizes.budgets_s]
    if sorted(named) != sorted(STEP_ORDER):
        problems.append(f"budgets name {named}, the steps are {list(STEP_ORDER)}")
    spare = sizes.total_limit_s - sizes.total_budget_s
    if spare < MARGIN_S:
        problems.append(
            f"the budgets add up to {sizes.total_budget_s:.0f} s: {spare:.0f} s left of the "
            f"{sizes.total_limit_s:.0f} s limit, less than the {MARGIN_S:.0f} s margin"
        )
    return problems


def plan_text(sizes: Sizes, steps: tuple[str, ...] = STEP_ORDER) -> str:
    """The plan as printed by ``--dry-plan``: each step's budget and when it must end."""
    lines = [f"{'step':<18}{'budget s':>9}{'ends by s':>11}"]
    end = 0.0
    for name in steps:
        end += sizes.budget(name)
        lines.append(f"{name:<18}{sizes.budget(name):>9.0f}{end:>11.0f}")
    lines.append(f"{'total':<18}{end:>9.0f}   limit {sizes.total_limit_s:.0f} s, margin "
                 f"{sizes.total_limit_s - end:.0f} s")  # fmt: skip
    return "\n".join(lines)
