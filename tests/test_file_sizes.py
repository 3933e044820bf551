"""No core file of pdserve grows past MAX_LINES: a file that long holds more than one job
(docs/architecture.md, "The folder list is the architecture"); split it along a real seam."""

from __future__ import annotations

from pathlib import Path

import pdserve

MAX_LINES = 400
PACKAGE_DIR = Path(pdserve.__file__).parent


def long_files(root: Path, max_lines: int = MAX_LINES) -> dict[str, int]:
    """Python files under ``root`` longer than ``max_lines``, with their line counts."""
    counts = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    return {name: n for name, n in sorted(counts.items()) if n > max_lines}


def test_no_core_file_is_over_400_lines() -> None:
    assert long_files(PACKAGE_DIR) == {}


def test_the_size_check_reports_a_long_file(tmp_path: Path) -> None:
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert long_files(tmp_path) == {"sub/long.py": MAX_LINES + 1}
