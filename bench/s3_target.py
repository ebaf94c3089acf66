"""The S3 endpoint a benchmark measures against: the test servers' MinIO when
ELASTRAIN_S3_ENDPOINT (+ _ACCESS_KEY, _SECRET_KEY, _BUCKET) names one, else a MinIO of its own
started from the project's cached build (hack/cluster.py), stopped afterwards. Either way the
AWS_* variables are set for boto3 and the trainer.

hack/cluster.py keeps MinIO's data on tmpfs (/dev/shm). Gigabyte benchmarks ask for
`s3_target(disk=True)`: always a MinIO of its own whose data directory is on disk (under
$ELASTRAIN_BENCH_DIR, default /var/tmp), removed with everything in it afterwards."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from elastrain_trainer.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def s3_target(*, disk: bool = False) -> Iterator[tuple[str, str]]:
    """(endpoint, bucket) for the duration of the block."""
    if disk:
        with _disk_minio() as target:
            yield target
        return
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


@contextmanager
def _disk_minio() -> Iterator[tuple[str, str]]:
    cluster = _hack_cluster()
    binary = cluster.find_binaries().minio
    if not binary.exists():
        cluster.build(["minio"])
    base = Path(tempfile.mkdtemp(prefix="elastrain-bench-minio-",
                                 dir=os.environ.get("ELASTRAIN_BENCH_DIR", "/var/tmp")))
    key, secret, bucket = "elastrain-bench", "elastrain-bench-secret", "elastrain-bench"
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = {**os.environ, "MINIO_ROOT_USER": key, "MINIO_ROOT_PASSWORD": secret,
           "MINIO_BROWSER": "off", "MINIO_UPDATE": "off", "MINIO_REGION": "us-east-1",
           # Deleted objects leave MinIO's trash after this long instead of minutes.
           "MINIO_API_DELETE_CLEANUP_INTERVAL": "5s"}
    log = open(base / "minio.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([str(binary), "server", "--quiet", "--address", f"127.0.0.1:{port}",
                             "--console-address", f"127.0.0.1:{free_port()}",
                             str(base / "data")], env=env, stdout=log, stderr=log)
    try:
        _wait_ready(endpoint, proc)
        os.environ.update(AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret,
                          AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        yield endpoint, bucket
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(base, ignore_errors=True)


def _wait_ready(endpoint: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"minio exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(endpoint + "/minio/health/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("minio did not become ready in 60 s")


def _hack_cluster():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("elastrain_hack_cluster",
                                                  ROOT / "hack" / "cluster.py")
    assert spec is not None and spec.loader is not None
    cluster = importlib.util.module_from_spec(spec)
    sys.modules["elastrain_hack_cluster"] = cluster
    spec.loader.exec_module(cluster)
    return cluster
