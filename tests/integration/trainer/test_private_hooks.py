"""The private hooks that need a server or real processes (elastrain_trainer.private_hooks):
a ranged S3 read from the real MinIO goes straight from http.client's socket into the buffer
(botocore's StreamingBody._raw_stream -> urllib3's HTTPResponse._fp), and the crash-budget agent
is the one torchrun's own launch_agent builds and runs (a real worker process)."""

from __future__ import annotations

import json
import os
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.launcher import api as launcher_api

from elastrain_trainer.checkpoint import s3_transfer
from elastrain_trainer.checkpoint.s3 import S3Storage
from elastrain_trainer.launch import agent as launch_agent
from elastrain_trainer.ports import free_port

MIB = 1 << 20


@pytest.fixture
def storage(s3_credentials: Any) -> Iterator[S3Storage]:
    s3 = s3_credentials
    store = S3Storage(f"s3://{s3.bucket}/trainer-tests/hooks-{uuid.uuid4().hex[:10]}",
                      endpoint_url=s3.endpoint_url)
    yield store
    store.delete(store.list())


def events(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith('{"event"')]


@pytest.mark.s3
def test_a_ranged_read_goes_straight_from_the_socket(
        storage: S3Storage, capsys: pytest.CaptureFixture[str]) -> None:
    data = os.urandom(3 * MIB + 5)
    storage.write("obj", data)
    response = storage.client.get_object(Bucket=storage.bucket, Key=f"{storage.prefix}/obj",
                                         Range=f"bytes=0-{MIB - 1}")
    body: Any = response["Body"]
    direct = body._raw_stream._fp  # what s3_transfer._read_body_into reads into
    into = bytearray(MIB)
    assert direct.readinto(memoryview(into)) == MIB
    assert into == data[:MIB]
    body.close()

    into = bytearray(len(data))
    storage.read_into("obj", memoryview(into))
    assert into == data
    assert not [e for e in events(capsys.readouterr().out)
                if e["event"] == "private_hook_missing"]


class RenamedRawStream:
    """A botocore whose StreamingBody keeps its urllib3 response under another name."""

    def __init__(self, body: Any) -> None:
        self._body = body

    def read(self, amt: int | None = None) -> bytes:
        return bytes(self._body.read(amt))

    def close(self) -> None:
        self._body.close()


class RenamingClient:
    def __init__(self, client: Any) -> None:
        self._client = client

    def get_object(self, **kwargs: Any) -> Any:
        response = self._client.get_object(**kwargs)
        return {**response, "Body": RenamedRawStream(response["Body"])}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@pytest.mark.s3
def test_without_the_raw_stream_a_read_is_still_right_and_says_so_once(
        storage: S3Storage, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(2 * MIB + 1)
    storage.write("obj", data)
    monkeypatch.setattr(s3_transfer, "_no_direct_read_said", threading.Event())
    monkeypatch.setattr(storage, "client", RenamingClient(storage.client))
    for _ in range(2):
        into = bytearray(len(data))
        storage.read_into("obj", memoryview(into))
        assert into == data
    said = [e for e in events(capsys.readouterr().out) if e["event"] == "private_hook_missing"]
    assert [e["hook"] for e in said] == ["StreamingBody._raw_stream._fp"]


@pytest.fixture
def unpatched_launcher() -> Iterator[None]:
    agent = launcher_api.LocalElasticAgent  # type: ignore[attr-defined]
    yield
    launcher_api.LocalElasticAgent = agent  # type: ignore[attr-defined]


@pytest.mark.torchrun
@pytest.mark.timeout(120)
def test_torchruns_launch_agent_runs_the_crash_budget_agent(unpatched_launcher: None,
                                                            tmp_path: Path) -> None:
    launch_agent.patch_crash_budget()
    config = launcher_api.LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=1, run_id=uuid.uuid4().hex,
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=5,
        monitor_interval=0.1, rdzv_configs={"join_timeout": 30})
    with pytest.raises(launch_agent.WorkerCrashed, match="rank 0, exit code 3"):
        # Without the patch torch restarts the crashing worker in place 5 times.
        launcher_api.elastic_launch(config, sys.executable)("-c", "raise SystemExit(3)")
