"""The C++ decoder loop (model/cpp_layers.py) gives every token the bits of the Python loop:
prompt rows and decode steps, over dense and GGUF-quantized weights, with QKV bias (Qwen2) and a
sliding window (Mistral); and it is the loop that runs where it can. A mixed step (a prompt
beside decode rows) is not one of those: it takes the Python loop, and gives each row the bits
the C++ loop gives it in its own step."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

import pdserve.model.llama as llama
from pdserve.model import cpp_layers
from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.sampling_params import SamplingParams
from pdserve.sequence import Sequence
from tests.model.checkpoints import write_checkpoint
from tests.model.gguf.conftest import demo_gguf

PROMPT_LENS = [5, 17, 33, 8]
NUM_STEPS = 6


def _runner(model: Path) -> ModelRunner:
    runner = ModelRunner(RunnerConfig(str(model), page_size=4, num_pages=96))
    if runner.attn_backend.name != "cpp":
        pytest.skip("the C++ kernels do not run here")
    return runner


def _seqs(runner: ModelRunner, lens: list[int], first_page: int) -> list[Sequence]:
    gen = torch.Generator().manual_seed(sum(lens))
    vocab = runner.model_config.vocab_size
    return [
        Sequence(f"s{first_page}-{i}", torch.randint(0, vocab, (n,), generator=gen).tolist(), n,
                 SamplingParams(temperature=0), list(range(first_page + 16 * i,
                                                           first_page + 16 * (i + 1))))
        for i, n in enumerate(lens)
    ]  # fmt: skip


def _advance(seqs: list[Sequence], logits: torch.Tensor) -> None:
    for s, row in zip(seqs, logits, strict=True):
        s.num_cached_tokens = s.num_tokens
        s.token_ids.append(int(row.argmax()))


def _run(runner: ModelRunner) -> list[torch.Tensor]:
    """A ragged prefill, then decode steps."""
    seqs = _seqs(runner, PROMPT_LENS, 0)
    out = [runner.prefill_logits(seqs)]
    for _ in range(NUM_STEPS):
        _advance(seqs, out[-1])
        out.append(runner.decode_logits(seqs))
    return out


def _assert_same_bits(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fused = _runner(model)
    fused_out = _run(fused)
    assert fused.model._cpp_layers is not None and fused.model._cpp_layers[1] is not None
    monkeypatch.setattr(llama, "cpp_decoder_layers", lambda *args: None)
    python_out = _run(_runner(model))
    for a, b in zip(fused_out, python_out, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_dense_weights_give_the_python_loop_s_bits(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _assert_same_bits(write_checkpoint(tmp_path / arch, arch), monkeypatch)


def test_a_bf16_checkpoint_as_served_gives_the_python_loop_s_bits(
    demo_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _assert_same_bits(demo_dir, monkeypatch)  # bf16 weights, bf16 KV cache: the default dtype


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_gguf_weights_give_the_python_loop_s_bits(
    qtype: str, demo_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _assert_same_bits(demo_gguf(demo_dir, tmp_path, qtype), monkeypatch)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_a_mixed_step_takes_the_python_loop_and_gives_each_row_its_own_step_s_bits(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C++ stack runs one attention call over all rows; a mixed step's attention is two
    (model/cpp_layers.py), so it runs the Python loop, whose rows must equal what the C++ loop
    gives the prompt alone and the decode rows alone."""
    runner = _runner(write_checkpoint(tmp_path / arch, arch))
    ran: list[bool] = []
    run = cpp_layers.CppDecoderLayers.run

    def spy(self: cpp_layers.CppDecoderLayers, *args: object) -> bool:
        ran.append(run(self, *args))
        return ran[-1]

    monkeypatch.setattr(cpp_layers.CppDecoderLayers, "run", spy)
    seqs = _seqs(runner, PROMPT_LENS, 0)
    _advance(seqs, runner.prefill_logits(seqs))
    prompt = _seqs(runner, [11], 64)
    batch, rows = runner._extend_batch(prompt, seqs)  # the prompt, then the decode rows
    assert batch.parts is not None
    ran.clear()
    with torch.inference_mode():
        mixed = runner.model.logits(runner._forward(batch)[rows])
    assert ran == [False], "the mixed step did not take the Python loop"
    # Each part alone, on the same pages (rewriting the same K/V): the C++ loop runs both.
    alone = torch.cat([runner.prefill_logits(prompt), runner.decode_logits(seqs)])
    assert ran == [False, True, True]
    assert torch.equal(mixed, alone)


def test_qwen3_s_head_norms_keep_the_python_loop(tmp_path: Path) -> None:
    runner = _runner(write_checkpoint(tmp_path / "qwen3", "qwen3"))
    runner.prefill_logits(_seqs(runner, [3], 0))
    assert runner.model._cpp_layers is not None and runner.model._cpp_layers[1] is None


def _refuse_to_load() -> None:
    raise AssertionError("the C++ CPU kernels were loaded for a CUDA model")


def test_a_cuda_model_takes_the_python_loop_without_loading_the_cpu_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CUDA run the choice of loop is made from the model's device before anything loads
    the C++ CPU module (its build takes minutes). CUDA cannot run here: the model is built on
    the CPU and then declared a CUDA model, which is all the choice reads."""
    model = write_checkpoint(tmp_path / "llama", "llama")
    cpu = _runner(model)
    want = cpu.prefill_logits(_seqs(cpu, PROMPT_LENS, 0))
    runner = _runner(model)
    runner.model.device = torch.device("cuda")
    monkeypatch.setattr(cpp_layers, "cpu_ext", types.SimpleNamespace(load=_refuse_to_load))
    got = runner.prefill_logits(_seqs(runner, PROMPT_LENS, 0))
    assert runner.model._cpp_layers is not None and runner.model._cpp_layers[1] is None
    assert torch.equal(got, want)  # the Python loop: the C++ loop's bits


def test_only_a_cpu_device_uses_the_cpp_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = _runner(write_checkpoint(tmp_path / "llama", "llama"))
    m = runner.model
    monkeypatch.setattr(cpp_layers, "cpu_ext", types.SimpleNamespace(load=_refuse_to_load))
    for device in ("cuda", "cuda:0", "meta"):
        assert not cpp_layers.uses_cpp_stack(torch.device(device), m.layers, m.act_dtype,
                                             runner.attn_backend)  # fmt: skip
    assert cpp_layers.uses_cpp_stack(torch.device("cpu"), m.layers, m.act_dtype,
                                     runner.attn_backend)  # fmt: skip
