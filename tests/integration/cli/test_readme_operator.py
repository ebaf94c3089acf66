"""The README's two operator command lines, run as written (with the test's namespace for `ml`)
against the real apiserver: each starts the operator, which turns a TrainingJob into worker pods
and stops cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import kubectl
from tests.unit.cli.readme import ROOT, documented_commands, executable
from tests.unit.operator.builders import make_job_manifest

pytestmark = pytest.mark.cluster

OPERATOR_COMMANDS = [c for c in documented_commands()
                     if c[:2] == ["elastrain", "operator"]
                     or c[:3] == ["python", "-m", "elastrain_operator"]]


def test_readme_names_both_operator_commands() -> None:
    assert [c[:2] for c in OPERATOR_COMMANDS] == [["python", "-m"], ["elastrain", "operator"]]


@pytest.mark.parametrize("argv", OPERATOR_COMMANDS, ids=" ".join)
def test_documented_operator_command_runs_the_operator(
        crd: Any, kube_namespace: str, tmp_path: Path, argv: list[str]) -> None:
    at = argv.index("-n") + 1
    command = executable([*argv[:at], kube_namespace, *argv[at + 1:]])
    env = {**os.environ, "KUBECONFIG": str(crd.kubeconfig),
           "ELASTRAIN_TIMER_INTERVAL_SECONDS": "1", "ELASTRAIN_HANDLER_BACKOFF_SECONDS": "1"}
    log_path = tmp_path / "operator.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

    def workers() -> list[Any]:
        return list(json.loads(kubectl(
            crd, "get", "pods", "-n", kube_namespace, "-o", "json", "-l",
            "elastrain.dev/job-name=readme,elastrain.dev/role=worker").stdout)["items"])

    try:
        kubectl(crd, "apply", "-n", kube_namespace, "-f", "-",
                input_text=json.dumps(make_job_manifest("readme", replicas=2)))
        deadline = time.monotonic() + 60
        while len(workers()) < 2:
            assert proc.poll() is None, f"{command} exited:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"no workers:\n{log_path.read_text()}"
            time.sleep(0.5)
    finally:
        proc.terminate()
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(10)
    logs = log_path.read_text()
    assert code == 0, logs
    assert "Traceback (most recent call last)" not in logs, logs
