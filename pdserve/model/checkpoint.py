"""One entry point per thing a worker reads from a checkpoint, whatever its format.

``--model`` names a Hugging Face directory (config.json, tokenizer.json, safetensors) or a GGUF
file (or a directory holding one); each function here picks the reader once per call.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.model.config import ModelConfig, ModelDirError

if TYPE_CHECKING:  # torch and tokenizers stay unloaded for the launcher's config check
    import torch

    from pdserve.model.tokenizer import Tokenizer
    from pdserve.model.weights import ModelWeights


def _gguf(path: str | Path):  # noqa: ANN202 - GGUFFile, imported lazily (gguf is heavy)
    from pdserve.model.gguf.file import find_gguf, open_gguf

    found = find_gguf(path)
    return open_gguf(found) if found is not None else None


def _check_exists(path: str | Path) -> None:
    if not Path(path).exists():
        raise ModelDirError(f"model {str(path)!r} does not exist")
    if Path(path).is_file() and Path(path).suffix.lower() != ".gguf":
        raise ModelDirError(f"model {str(path)!r} is a file but not a .gguf file")


def load_model_config(path: str | Path) -> ModelConfig:
    """The architecture of the checkpoint at ``path``."""
    _check_exists(path)
    f = _gguf(path)
    if f is None:
        return ModelConfig.from_dir(path)
    from pdserve.model.gguf.config import gguf_model_config

    return gguf_model_config(f)


def check_model_config(path: str | Path) -> ModelConfig:
    """:func:`load_model_config` for a process that serves nothing (the launcher's check before
    it starts workers): no parse of the file stays cached in it."""
    try:
        return load_model_config(path)
    finally:
        from pdserve.model.gguf.file import forget_parsed_files

        forget_parsed_files()


def load_tokenizer(path: str | Path) -> Tokenizer:
    f = _gguf(path)
    if f is None:
        from pdserve.model.tokenizer import Tokenizer

        return Tokenizer.from_dir(path)
    from pdserve.model.gguf.tokenizer import gguf_tokenizer

    return gguf_tokenizer(f)


# What ``--dtype auto`` keeps a block-quantized GGUF's dense weights in (the embedding table,
# dequantized; the norms, F32 in the files). On CPUs float32, which holds every dequantized
# value exactly (activations are float32 there anyway); on CUDA the quantized weights are
# dequantized to bf16 at load.
QUANTIZED_CPU_DTYPE, QUANTIZED_CUDA_DTYPE = "float32", "bfloat16"


def is_block_quantized(path: str | Path, config: ModelConfig) -> bool:
    """A GGUF whose projections are block-quantized (its dense dtype is pdserve's choice)."""
    return config.checkpoint_dtype is None and _gguf(path) is not None


def declared_dtype(path: str | Path, config: ModelConfig, device: torch.device) -> str | None:
    """The dtype the checkpoint is stored in (what ``--dtype auto`` runs)."""
    if config.checkpoint_dtype is not None:
        return config.checkpoint_dtype
    if is_block_quantized(path, config):
        return QUANTIZED_CPU_DTYPE if device.type == "cpu" else QUANTIZED_CUDA_DTYPE
    from pdserve.model.loader import stored_dtype

    return stored_dtype(path)


def load_model_weights(
    path: str | Path, config: ModelConfig, dtype: torch.dtype, device: str = "cpu"
) -> ModelWeights:
    f = _gguf(path)
    if f is None:
        from pdserve.model.loader import load_weights

        return load_weights(path, config, dtype, device)
    from pdserve.model.gguf.weights import load_gguf_weights

    return load_gguf_weights(f, config, dtype, device)


def release_checkpoint_file(path: str | Path) -> None:
    """Once the model is built from ``path``: a GGUF file's mapped pages leave this process's
    resident set (the kernels hold their packed copy) and its cached parse is dropped, so the
    file's bytes are in memory once. Nothing for a Hugging Face directory."""
    from pdserve.model.gguf.file import find_gguf, forget_parsed_files, open_gguf

    found = find_gguf(path)
    if found is not None:
        open_gguf(found).release_pages()
        forget_parsed_files()


def default_served_name(path: str | Path) -> str:
    """The model name clients use when none is given: the directory's, or a GGUF file's
    without its quantization suffix."""
    from pdserve.model.gguf.file import GGUF_SUFFIX, find_gguf, model_name_of

    p = Path(path)
    if p.suffix.lower() == GGUF_SUFFIX:
        return model_name_of(p)
    try:
        found = find_gguf(p)
    except ModelDirError:
        found = None
    return model_name_of(found) if found is not None else p.name
