"""Only the operator steers a trainer (issue 34 item 6): a GET of /progress, whatever its query,
changes nothing; POST /control changes the desired world only with the job's control token.
A real HTTP server (metrics.serve) on loopback."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastrain_trainer import metrics


@pytest.fixture
def port() -> Iterator[int]:
    server = metrics.serve(0, host="127.0.0.1")
    with metrics._lock:
        metrics._progress.desired_replicas = None
        metrics._progress.moving = frozenset()
        metrics._progress.lost = frozenset()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()


def post(port: int, body: Any, token: str | None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(f"http://127.0.0.1:{port}/control", method="POST",
                                 data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as rsp:
            return rsp.status, json.loads(rsp.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def test_a_scrape_with_a_replicas_query_changes_nothing(port: int) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/progress?replicas=1", timeout=5):
        pass
    assert metrics.desired_replicas() is None


def test_control_needs_the_jobs_token(port: int, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    status, _ = post(port, {"replicas": 1}, "anything")
    assert status == 403 and metrics.desired_replicas() is None  # no token file: control off
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    monkeypatch.setenv(metrics.CONTROL_TOKEN_FILE_ENV, str(token))
    for wrong in (None, "", "s3cret", "s3cret-token-and-more"):
        status, _ = post(port, {"replicas": 1}, wrong)
        assert status == 401 and metrics.desired_replicas() is None, wrong
    for bad in ({"replicas": 0}, {"replicas": True}, {"replicas": "2"}, [2]):
        status, _ = post(port, bad, "s3cret-token")
        assert status == 400 and metrics.desired_replicas() is None, bad
    status, document = post(port, {"replicas": 3}, "s3cret-token")
    assert status == 200 and metrics.desired_replicas() == 3
    assert "step" in document and "checkpointHealth" in document  # the /progress document
    token.write_text("rotated\n")  # read per request: a rotated Secret takes effect
    assert post(port, {"replicas": 2}, "s3cret-token")[0] == 401
    assert post(port, {"replicas": 2}, "rotated")[0] == 200 and metrics.desired_replicas() == 2


def test_the_operators_poll_tells_the_desired_world_with_the_jobs_token(
        port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from elastrain_operator.control import job_token
    from elastrain_operator.probe import fetch_progress

    token = job_token(b"operator key", "uid-1")
    (tmp_path / "token").write_text(token)
    monkeypatch.setenv(metrics.CONTROL_TOKEN_FILE_ENV, str(tmp_path / "token"))
    # Another key's token: refused, and the progress read the plain way.
    assert fetch_progress("127.0.0.1", port, replicas=2, token=job_token(b"other", "uid-1")) \
        is not None and metrics.desired_replicas() is None
    report = fetch_progress("127.0.0.1", port, replicas=2, token=token)
    assert report is not None and metrics.desired_replicas() == 2


def test_control_names_the_pods_that_move_and_refuses_a_bad_list(
        port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from elastrain_operator.control import job_token
    from elastrain_operator.probe import fetch_progress

    token = job_token(b"operator key", "uid-1")
    (tmp_path / "token").write_text(token)
    monkeypatch.setenv(metrics.CONTROL_TOKEN_FILE_ENV, str(tmp_path / "token"))
    for bad in ("w-0", [1], [""], ["w"] * (metrics.MAX_MOVING + 1)):
        status, _ = post(port, {"replicas": 2, "moving": bad}, token)
        assert status == 400 and metrics.desired_replicas() is None, bad
    assert metrics.moving_pods() == frozenset()
    # What the operator's poll sends while a worker moves; the next poll's list replaces it.
    assert fetch_progress("127.0.0.1", port, replicas=2, token=token,
                          moving=("w-0-0", "w-1-0")) is not None
    assert metrics.moving_pods() == {"w-0-0", "w-1-0"} and metrics.desired_replicas() == 2
    assert post(port, {"replicas": 2}, token)[0] == 200 and metrics.moving_pods() == frozenset()


def test_control_names_the_pods_on_lost_nodes_and_refuses_a_bad_list(
        port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from elastrain_operator.control import job_token
    from elastrain_operator.probe import fetch_progress

    token = job_token(b"operator key", "uid-1")
    (tmp_path / "token").write_text(token)
    monkeypatch.setenv(metrics.CONTROL_TOKEN_FILE_ENV, str(tmp_path / "token"))
    for bad in ("w-2-0", [None], ["w"] * (metrics.MAX_MOVING + 1)):
        assert post(port, {"replicas": 3, "lost": bad}, token)[0] == 400, bad
    assert metrics.lost_pods() == frozenset() and metrics.desired_replicas() is None
    assert fetch_progress("127.0.0.1", port, replicas=3, token=token,
                          lost=("w-2-0",)) is not None
    assert metrics.lost_pods() == {"w-2-0"} and metrics.moving_pods() == frozenset()
    assert post(port, {"replicas": 3}, token)[0] == 200 and metrics.lost_pods() == frozenset()
