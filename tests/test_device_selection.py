"""What ``pytest --device-only cuda`` selects on a GPU machine, checked on a CPU.

bench/gpu_check.py runs its device tests that way. A test whose device comes from a tuple
parameter or a ``torch.device`` (not the ``device`` fixture's string) was once deselected
silently, so graph replay, per-architecture parity and the logits processors never ran on the
GPU (issue 22). Collection here runs in a subprocess that reports CUDA as present, so the
fixtures parametrise by "cuda" as they do on the device; it must select every test named
below, each at least as many times as listed, and must not build the C++ CPU kernels.
"""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_check import DEVICE_TEST_PATHS

REPO = Path(__file__).resolve().parents[1]
# Collection as on a GPU machine: CUDA reported present, the C++ kernels' loader a tripwire.
# pytest captures stdout and stderr while it collects (a print there reaches no one), so each
# load is recorded, with the stack that asked, in the file named by the first argument.
COLLECT = """
import sys, traceback, torch
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
from pdserve.kernels import cpu_ext
record = sys.argv[1]
def tripwire(*args, **kwargs):
    with open(record, "a") as f:
        f.write("".join(traceback.format_stack(limit=6)) + "---\\n")
cpu_ext.load = tripwire
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "--device-only", "cuda",
                      *sys.argv[2:]]))
"""


def collect_as_on_a_gpu(
    paths: list[str], record: Path, *extra: str
) -> tuple[subprocess.CompletedProcess[str], str]:
    """``pytest --collect-only --device-only cuda paths``, and what loaded the C++ kernels."""
    proc = subprocess.run(
        [sys.executable, "-c", COLLECT, str(record), *extra, *paths],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return proc, record.read_text() if record.exists() else ""


# test -> the fewest cuda items it must have (its cuda parametrisations today).
REQUIRED = {
    "tests/model/test_graph_runner.py::test_cuda_graph_replays_equal_eager_steps": 2,
    "tests/model/test_graph_runner.py::"
    "test_padded_steps_equal_eager_decode_and_padding_lands_on_the_scratch_page": 2,
    "tests/model/test_llama.py::test_prefill_and_decode_logits_match_transformers": 6,
    "tests/model/test_llama.py::"
    "test_greedy_generation_is_token_identical_to_transformers_generate": 6,
    "tests/attention/test_backends.py::test_backends_match_the_torch_backend": 4,
    "tests/attention/test_backends.py::"
    "test_a_mixed_step_gives_its_chunks_and_decode_rows_what_each_part_gives_alone": 4,
    "tests/kernels/test_logits_processors.py::"
    "test_grammar_rows_keep_only_allowed_tokens_and_no_padded_ids": 1,
    "tests/kernels/test_logits_processors.py::"
    "test_every_row_constrained_masks_each_row_by_its_own_matcher": 1,
    "tests/kernels/test_sampling_sync_free.py::test_sampler_on_each_device_agrees_with_the_cpu": 8,
    "tests/kernels/test_sampling_sync_free.py::"
    "test_the_sorted_top_p_floor_equals_the_bisection_one": 1,
    "tests/kernels/test_host_copy.py::test_packed_copy_round_trips_ids_and_logprobs_exactly": 3,
    "tests/kernels/triton/test_decode.py::"
    "test_decode_matches_torch_reference_over_scattered_pages": 12,
    "tests/kernels/triton/test_extend.py::"
    "test_extend_matches_torch_reference_over_a_cached_prefix": 12,
    "tests/test_model_runner.py::test_prompts_at_page_boundaries_match_transformers": 4,
    "tests/test_model_runner.py::test_fixed_seed_reproduces_whatever_the_batch": 1,
}


@pytest.mark.slow
def test_device_only_cuda_selects_the_model_graph_attention_and_sampling_tests(
    tmp_path: Path,
) -> None:
    proc, loads = collect_as_on_a_gpu(list(DEVICE_TEST_PATHS), tmp_path / "loads.txt")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    selected = [ln for ln in proc.stdout.splitlines() if "::" in ln]
    assert "deselected" in proc.stdout.splitlines()[-1], "the CPU items were not deselected"
    counts = collections.Counter(ln.rsplit("[", 1)[0] for ln in selected)
    short = {name: (counts[name], want) for name, want in REQUIRED.items() if counts[name] < want}
    assert short == {}, "selected (got, want) times"
    assert loads == "", "collection built the C++ CPU kernels:\n" + loads


def test_the_tripwire_records_a_kernel_load_made_while_pytest_collects(tmp_path: Path) -> None:
    """The guard above can fail: a test module that loads the kernels at import is caught,
    though pytest captures the output of collection."""
    probe = tmp_path / "test_loads_at_import.py"
    probe.write_text(
        "from pdserve.kernels import cpu_ext\n"
        "MODULE = cpu_ext.load()\n"
        "def test_cuda_only(device):\n    assert device\n"
    )
    record = tmp_path / "loads.txt"
    proc, loads = collect_as_on_a_gpu([str(probe)], record, "-p", "tests.conftest")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "test_loads_at_import.py" in loads, loads
