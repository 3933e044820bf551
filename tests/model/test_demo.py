"""The built-in demo model: deterministic, Hugging Face loadable, served by the runner."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from pdserve.model.demo import DemoShape, ensure_demo_model, is_demo_model, main, write_demo_model
from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.sampling_params import SamplingParams
from pdserve.sequence import Sequence


def _digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_demo_model_is_deterministic(demo_dir: Path, tmp_path: Path) -> None:
    assert main([str(tmp_path / "again")]) == 0
    assert _digest(tmp_path / "again") == _digest(demo_dir)


def test_weight_seed_changes_only_the_weights(demo_dir: Path, tmp_path: Path) -> None:
    other = write_demo_model(tmp_path / "seed1", DemoShape(seed=1))
    changed = {k for k, v in _digest(other).items() if _digest(demo_dir)[k] != v}
    assert changed == {"model.safetensors"}


def test_transformers_loads_the_demo_and_agrees_with_the_runner(demo_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    runner = ModelRunner(RunnerConfig(str(demo_dir), dtype="float32", num_pages=16))
    prompt = runner.tokenizer.encode("def main():")
    seq = Sequence("d", list(prompt), len(prompt), SamplingParams(temperature=0), list(range(4)))
    ours = runner.prefill_logits([seq])[0]
    ref_model = AutoModelForCausalLM.from_pretrained(str(demo_dir), dtype=torch.float32)
    with torch.no_grad():
        ref = ref_model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    cfg = runner.model_config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (256, 4, 4, 2)
    assert 2000 <= cfg.vocab_size <= 4096


def test_ensure_demo_model_writes_once_then_reuses(tmp_path: Path) -> None:
    target = tmp_path / "cache" / "demo"
    assert ensure_demo_model(target) == target and is_demo_model(target)
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(target) == target
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in target.parent.iterdir()] == ["demo"]  # no temp dirs left behind


def test_ensure_demo_model_replaces_a_partial_directory(tmp_path: Path) -> None:
    target = tmp_path / "demo"
    target.mkdir()
    (target / "config.json").write_text("{}")
    ensure_demo_model(target)
    assert is_demo_model(target) and (target / "tokenizer.json").is_file()
