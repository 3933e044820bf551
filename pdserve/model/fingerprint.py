"""A checkpoint's weights fingerprint: which weights a worker serves, cheap enough for start-up.

Two checkpoints of one architecture (a base model and its fine-tune) have the same config and
page layout, so the KV one computes is garbage to the other. The fingerprint hashes, for every
tensor of every safetensors file in name order, its name, stored dtype, shape and its first
``SAMPLE_BYTES`` bytes as stored (read straight from the file, before any conversion: the run
dtype and device do not change it). A fine-tune changes every tensor's first bytes; reading a
few KiB per tensor costs milliseconds even for a large checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from pdserve.model.config import ModelDirError
from pdserve.model.loader import checkpoint_files

SAMPLE_BYTES = 4096  # of each tensor, from its start
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on the JSON header


def weights_fingerprint(model_dir: str | Path) -> str:
    """A short stable hash of the checkpoint's tensors (names, dtypes, shapes, first bytes)."""
    from pdserve.model.gguf.file import find_gguf

    gguf_path = find_gguf(model_dir)
    if gguf_path is not None:
        return _gguf_fingerprint(gguf_path)
    digest = hashlib.sha256()
    for path in checkpoint_files(Path(model_dir)):
        with open(path, "rb") as f:
            header = _header(f.read(8), path)
            raw = f.read(header)
            try:
                tensors = json.loads(raw)
            except ValueError as exc:
                raise ModelDirError(f"{path}: safetensors header is not JSON: {exc}") from None
            data_start = 8 + header
            for name in sorted(k for k in tensors if k != "__metadata__"):
                entry = tensors[name]
                begin, end = entry["data_offsets"]
                f.seek(data_start + begin)
                sample = f.read(min(SAMPLE_BYTES, end - begin))
                digest.update(f"{name}|{entry['dtype']}|{entry['shape']}|".encode())
                digest.update(sample)
    return digest.hexdigest()[:16]


def _gguf_fingerprint(path: Path) -> str:
    """The same hash over a GGUF file's tensors (GGML type names, shapes, first bytes)."""
    from pdserve.model.gguf.file import open_gguf

    digest = hashlib.sha256()
    tensors = open_gguf(path).tensors
    for name in sorted(tensors):
        t = tensors[name]
        shape = [int(d) for d in reversed(t.shape)]
        digest.update(f"{name}|{t.tensor_type.name}|{shape}|".encode())
        digest.update(t.data.reshape(-1).view("uint8")[:SAMPLE_BYTES].tobytes())
    return digest.hexdigest()[:16]


def _header(raw: bytes, path: Path) -> int:
    if len(raw) != 8:
        raise ModelDirError(f"{path} is too short to be a safetensors file")
    (size,) = struct.unpack("<Q", raw)
    if size > _MAX_HEADER_BYTES:
        raise ModelDirError(f"{path}: safetensors header of {size} bytes")
    return size
