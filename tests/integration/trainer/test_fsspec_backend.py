"""The fsspec backend at trainer start: a scheme whose package the image lacks stops a real trainer
with a message naming the package, not an ImportError trace; the start-up probe over s3fs on the
real MinIO passes, and what MinIO refuses through s3fs is diagnosed as permanent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastrain_trainer.checkpoint.fsspec_storage import FsspecStorage
from elastrain_trainer.checkpoint.precheck import probe

from .conftest import make_fsspec_s3_storage, subprocess_env, trainer_env

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


@pytest.mark.s3
def test_the_start_up_probe_passes_over_s3fs(s3_credentials: Any) -> None:
    assert probe(make_fsspec_s3_storage(s3_credentials), "host-1") is None


@pytest.mark.s3
@pytest.mark.parametrize(("change", "kind", "where"), [
    ({"secret": "not-the-secret"}, "access_denied", "list {root}/.elastrain-check"),
    # A missing bucket lists as empty; the write says why.
    ({"bucket": "no-such-bucket"}, "no_bucket", "write {root}/.elastrain-check/host-1")])
def test_what_s3fs_refuses_is_diagnosed_as_permanent(s3_credentials: Any, change: dict[str, str],
                                                     kind: str, where: str) -> None:
    s3 = s3_credentials
    bucket = change.get("bucket", s3.bucket)
    # Explicit keys: s3fs caches filesystems by their arguments, not by the environment.
    root = f"s3://{bucket}/trainer-tests/fsspec-refused"
    storage = FsspecStorage(root, s3.endpoint_url, key=s3.access_key,
                            secret=change.get("secret", s3.secret_key))
    problem = probe(storage, "host-1")
    assert problem is not None and (problem.kind, problem.permanent) == (kind, True), problem
    assert f"(on {where.format(root=root)}; fsspec s3fs.core.S3FileSystem" in problem.message, \
        problem.message
