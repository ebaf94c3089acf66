"""The fsspec backend in a real trainer process: a scheme whose package the image lacks stops the
trainer at start with a message naming the package, not an ImportError trace."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import subprocess_env, trainer_env

pytestmark = pytest.mark.timeout(240)


def test_a_trainer_without_gcsfs_exits_naming_the_package(tmp_path: Path) -> None:
    # Hide gcsfs even where it is installed: a None in sys.modules makes find_spec say "absent".
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['gcsfs'] = None\n")
    env = trainer_env(tmp_path, CHECKPOINT_URI="gs://bucket/run", STEPS="1")
    proc = subprocess.run([sys.executable, "-m", "elastrain_trainer"],
                          env=subprocess_env({**env, "PYTHONPATH": str(tmp_path)}),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert ("checkpoint location unusable, training not started: gs:// checkpoints need the "
            "Python package gcsfs, which this trainer image does not have") in proc.stderr, \
        proc.stderr[-3000:]
    assert "ImportError" not in proc.stderr and "ModuleNotFoundError" not in proc.stderr
