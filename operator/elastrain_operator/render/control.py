"""The job's control Secret, and how its in-process workers mount it (control.py says why).

Only in-process jobs are steered while they run (their desired world); Restart-mode workers
get neither the Secret nor the variable.
"""

from __future__ import annotations

import base64
from typing import Final

from elastrain_operator.model.names import ROLE_CONTROL, control_secret_name
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.render.meta import Manifest, child_metadata

CONTROL_VOLUME: Final = "elastrain-control"
TOKEN_DIR: Final = "/var/run/elastrain/control"
TOKEN_KEY: Final = "token"
TOKEN_FILE: Final = f"{TOKEN_DIR}/{TOKEN_KEY}"
# What the trainer reads (elastrain_trainer.metrics.CONTROL_TOKEN_FILE_ENV).
TOKEN_FILE_ENV: Final = "ELASTRAIN_CONTROL_TOKEN_FILE"


def controlled(job: TrainingJob) -> bool:
    return job.spec.in_process


def render_control_secret(job: TrainingJob, token: str) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": child_metadata(job, control_secret_name(job.metadata.name),
                                   role=ROLE_CONTROL),
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def control_volume(job: TrainingJob) -> tuple[Manifest, Manifest]:
    """(volume, volumeMount). Not a subPath: the kubelet then keeps the file current if the
    Secret is replaced, and the trainer reads it per request."""
    volume = {"name": CONTROL_VOLUME,
              "secret": {"secretName": control_secret_name(job.metadata.name),
                         "items": [{"key": TOKEN_KEY, "path": TOKEN_KEY}]}}
    return volume, {"name": CONTROL_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True}
