"""Fixtures for trainer integration tests: storages (file:// and MinIO), a one-rank process
group in the test process, and helpers to run and read real trainer processes."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from elastrain_trainer.checkpoint import CheckpointStorage
from elastrain_trainer.checkpoint.fsspec_storage import FsspecStorage
from elastrain_trainer.checkpoint.local import LocalStorage
from elastrain_trainer.checkpoint.s3 import S3Storage


def s3_env(s3: Any) -> dict[str, str]:
    """The standard AWS variables the trainer's boto3 reads."""
    return {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key,
            "AWS_REGION": s3.region, "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture
def s3_credentials(s3: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    for k, v in s3_env(s3).items():
        monkeypatch.setenv(k, v)
    return s3


def make_s3_storage(s3: Any, endpoint: str | None = None) -> S3Storage:
    return S3Storage(f"s3://{s3.bucket}/trainer-tests/{uuid.uuid4().hex[:10]}",
                     endpoint_url=endpoint or s3.endpoint_url)


def make_fsspec_s3_storage(s3: Any) -> FsspecStorage:
    """The fsspec backend over s3fs, against the same MinIO (s3fs reads the AWS_* variables)."""
    return FsspecStorage(f"s3://{s3.bucket}/trainer-tests/fsspec-{uuid.uuid4().hex[:10]}",
                         s3.endpoint_url)


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3), "fsspec-memory",
                        "fsspec-local", pytest.param("fsspec-s3", marks=pytest.mark.s3)])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CheckpointStorage]:
    """Each backend under a fresh root; the same tests run against all of them: our own file://
    and boto3 s3:// backends, and the fsspec backend over fsspec's memory and local filesystems
    and over s3fs."""
    if request.param == "file":
        yield LocalStorage(tmp_path / "ckpt")
        return
    if request.param == "fsspec-memory":
        root = f"memory://ckpt-{uuid.uuid4().hex[:10]}"
        yield FsspecStorage(root, fs=fsspec.filesystem("memory"))
        return
    if request.param == "fsspec-local":
        yield FsspecStorage(f"file://{tmp_path}/ckpt", fs=fsspec.filesystem("file"))
        return
    request.getfixturevalue("s3_credentials")
    s3 = request.getfixturevalue("s3")
    store: CheckpointStorage = (make_s3_storage(s3) if request.param == "s3"
                                else make_fsspec_s3_storage(s3))
    yield store
    store.delete(store.list())


@pytest.fixture(scope="module")
def one_rank_group() -> Iterator[None]:
    """A gloo world of one in this process, so DCP runs its collective code paths."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def trainer_env(tmp_path: Path, **overrides: str) -> dict[str, str]:
    """A small, fast, deterministic job (override any ELASTRAIN_* by keyword)."""
    env = {"ELASTRAIN_MODEL": "gpt-tiny", "ELASTRAIN_SEQ_LEN": "32",
           "ELASTRAIN_GLOBAL_BATCH_SIZE": "8", "ELASTRAIN_MICRO_BATCH_SIZE": "2",
           "ELASTRAIN_STEPS": "24", "ELASTRAIN_WARMUP_STEPS": "4", "ELASTRAIN_LR": "3e-3",
           "ELASTRAIN_METRICS_PORT": "0", "ELASTRAIN_CHECKPOINT_KEEP": "2",
           "ELASTRAIN_CHECKPOINT_URI": f"file://{tmp_path}/ckpt", "OMP_NUM_THREADS": "1"}
    env.update({k if k.startswith("ELASTRAIN_") else "ELASTRAIN_" + k.upper(): v
                for k, v in overrides.items()})
    return env


def subprocess_env(extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **extra}


def load_checkpoint(root: Path, step: int, out: Path) -> dict[str, Any]:
    """A committed DCP checkpoint as one plain (unsharded) state dict."""
    path = out / f"{root.parent.name}-step{step}.pt"
    dcp_to_torch_save(root / f"step-{step:08d}", path)
    state: dict[str, Any] = torch.load(path, weights_only=False)
    return state


def preempt_second_agent_at(cluster: Any, step: int) -> dict[str, int]:
    """Start 2 agents of a LocalCluster, SIGTERM the second once step `step` was trained (a
    notice), and return every agent's exit code; the cluster is stopped either way."""
    try:
        cluster.start(2)
        assert cluster.wait_for_step(step, timeout=120)
        cluster.preempt(cluster.agents[1])
        codes: dict[str, int] = cluster.wait_agents(timeout=180)
    finally:
        cluster.stop()
    return codes

