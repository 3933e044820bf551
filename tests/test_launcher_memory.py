"""``pdserve up`` serves nothing itself: on CPUs its checks leave neither torch nor a parse of
the model file in the launcher process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.real_models import SMOLLM2, real_model

_CHECK = """
import sys
import pdserve.launcher as launcher
from pdserve.model.gguf import file
cfg = launcher.cluster_config_from_args(launcher.parse_args(["--model", sys.argv[1]]))
launcher.check_model_config(cfg.model_dir)
assert "torch" not in sys.modules, "torch imported"
assert file._open.cache_info().currsize == 0, "a parse of the file is cached"
rss_kib = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])
print(rss_kib)
"""


def test_the_launcher_s_checks_import_no_torch_and_keep_no_parse_of_the_model() -> None:
    model = real_model(SMOLLM2)
    done = subprocess.run(
        [sys.executable, "-c", _CHECK, str(model)], capture_output=True, text=True, timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) < 150 * 1024  # KiB: Python, numpy, gguf; not a model
