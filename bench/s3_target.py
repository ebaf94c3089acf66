"""The S3 endpoint a benchmark measures against: the test servers' MinIO when
ELASTRAIN_S3_ENDPOINT (+ _ACCESS_KEY, _SECRET_KEY, _BUCKET) names one, else a MinIO of its own
started from the project's cached build (hack/cluster.py), stopped afterwards. Either way the
AWS_* variables are set for boto3 and the trainer."""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def s3_target() -> Iterator[tuple[str, str]]:
    """(endpoint, bucket) for the duration of the block."""
    stop = None
    endpoint = os.environ.get("ELASTRAIN_S3_ENDPOINT")
    if endpoint:
        key, secret = os.environ["ELASTRAIN_S3_ACCESS_KEY"], os.environ["ELASTRAIN_S3_SECRET_KEY"]
        bucket = os.environ.get("ELASTRAIN_S3_BUCKET", "elastrain-test")
    else:
        directory = Path(tempfile.mkdtemp())
        cluster = _hack_cluster()
        state = cluster.up(directory, tier="none", s3=True, die_with_parent=True)
        endpoint, key, secret, bucket = (state.s3_endpoint, state.s3_access_key,
                                         state.s3_secret_key, state.s3_bucket)

        def stop() -> None:
            cluster.down(directory)
    os.environ.update(AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret,
                      AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
    try:
        yield endpoint, bucket
    finally:
        if stop is not None:
            stop()


def _hack_cluster():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("elastrain_hack_cluster",
                                                  ROOT / "hack" / "cluster.py")
    assert spec is not None and spec.loader is not None
    cluster = importlib.util.module_from_spec(spec)
    sys.modules["elastrain_hack_cluster"] = cluster
    spec.loader.exec_module(cluster)
    return cluster
