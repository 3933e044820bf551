"""Find a GGUF file (a path to one, or a directory holding one) and open it once per process."""

from __future__ import annotations

import mmap
import re
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.model.config import ModelDirError

if TYPE_CHECKING:
    from gguf import ReaderTensor

    from pdserve.model.gguf.reader import FastGGUFReader

GGUF_SUFFIX = ".gguf"
_SHARD = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
_MISSING = object()


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: itself, or the one ``.gguf`` file of a directory without
    a ``config.json`` (that is a Hugging Face directory); None where ``path`` is not GGUF."""
    root = Path(path)
    if root.is_file():
        return root if root.suffix.lower() == GGUF_SUFFIX else None
    if not root.is_dir() or (root / "config.json").is_file():
        return None
    files = sorted(p for p in root.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(files) > 1:
        names = ", ".join(p.name for p in files)
        raise ModelDirError(f"{str(root)!r} holds several GGUF files ({names}): pass one")
    return files[0] if files else None


class GGUFFile:
    """One parsed GGUF file: its metadata values and tensors (memory-mapped, read on use)."""

    def __init__(self, path: Path) -> None:
        if _SHARD.search(path.name):
            raise ModelDirError(f"{path.name}: split (multi-file) GGUF files are not supported")
        from pdserve.model.gguf.reader import FastGGUFReader

        try:
            self.reader: FastGGUFReader = FastGGUFReader(path)
        except (ValueError, OSError) as e:
            raise ModelDirError(f"{str(path)!r} is not a readable GGUF file: {e}") from e
        self.path = path
        self.tensors: dict[str, ReaderTensor] = {t.name: t for t in self.reader.tensors}
        self.architecture: str = self.value("general.architecture", "")

    def value(self, key: str, default: Any = _MISSING) -> Any:
        """The metadata value under ``key`` (arrays as lists); ``default`` where absent."""
        if key in self.reader.arrays:
            return self.reader.arrays[key]
        field = self.reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise ModelDirError(f"{self.path.name}: metadata key {key!r} missing")
            return default
        return field.contents()

    def arch_value(self, suffix: str, default: Any = _MISSING) -> Any:
        """The architecture's own key, e.g. ``llama.block_count`` for ``block_count``."""
        return self.value(f"{self.architecture}.{suffix}", default)

    def release_pages(self) -> None:
        """Drops the mapped file's pages from this process's resident set (the packed panels
        are built, so nothing reads most of them again); views stay valid and fault back in the
        pages they read (the embedding rows looked up), shared with the page cache."""
        mapped = getattr(self.reader.data, "_mmap", None)
        if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
            mapped.madvise(mmap.MADV_DONTNEED)

    @property
    def model_name(self) -> str:
        """A served model name: the file name without ``.gguf`` and a quantization suffix
        (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``)."""
        return model_name_of(self.path)


def model_name_of(path: Path) -> str:
    stem = path.name[: -len(GGUF_SUFFIX)] if path.name.lower().endswith(GGUF_SUFFIX) else path.name
    # A trailing ".Q4_K_M" / "-Q8_0" / ".BF16" names the quantization, not the model.
    stripped = re.sub(r"[.-](?:I?Q\d\w*|[BF]F?16|F32)$", "", stem, flags=re.IGNORECASE)
    return stripped or stem


@lru_cache(maxsize=4)
def _open(path: Path, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | Path) -> GGUFFile:
    """The parsed file, cached: the config, tokenizer and weights loaders share one parse (a
    large vocabulary takes seconds to read)."""
    resolved = Path(path).resolve()
    return _open(resolved, resolved.stat().st_mtime_ns)


def forget_parsed_files() -> None:
    """Drops the cached parses (their metadata lists and tensor table): the launcher after its
    config check, a worker once its model is built; tensors still in use keep their mapping."""
    _open.cache_clear()
