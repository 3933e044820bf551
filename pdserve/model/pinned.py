"""A file checked against its pinned SHA-256, hashed once: after a check passes, a sidecar
stamp (``<file>.verified``: size, mtime, inode and the hash) says so, and later checks compare
the stamp with the file's metadata instead of reading it again. A file changed since (another
size, mtime or inode: rewritten or replaced) is hashed again; a stamp that cannot be written
only costs the next check a hash.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import orjson

_CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _fingerprint(path: Path, sha256: str) -> dict[str, object]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino, "sha256": sha256}


def mismatch(path: Path, sha256: str, size: int | None = None) -> str | None:
    """None if ``path`` holds the pinned bytes, else why not (the file's size or hash)."""
    try:
        stamp = orjson.loads(stamp_path(path).read_bytes())
        if stamp == _fingerprint(path, sha256):
            return None
    except (OSError, orjson.JSONDecodeError):
        pass
    actual_size = path.stat().st_size
    if size is not None and actual_size != size:
        return f"{actual_size} bytes, expected {size}"
    actual = sha256_of(path)
    if actual != sha256:
        return f"SHA-256 {actual}, expected {sha256}"
    write_stamp(path, sha256)
    return None


def write_stamp(path: Path, sha256: str) -> None:
    """Record that ``path`` (as it is now) was checked; best effort (a read-only models
    directory is fine)."""
    stamp = stamp_path(path)
    part = stamp.with_name(stamp.name + f".{os.getpid()}.part")
    try:
        part.write_bytes(orjson.dumps(_fingerprint(path, sha256)))
        os.replace(part, stamp)
    except OSError:
        part.unlink(missing_ok=True)
