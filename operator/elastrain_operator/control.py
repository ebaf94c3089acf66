"""The operator's control channel to a job's trainers (issue 34 item 6; not wired in yet).

Only the operator may change what a job's trainers do (today: the desired world of an in-process
job, which decides who waits as a spare). The trainers' /progress and /metrics are read by
scrapers too, so they change nothing; control is `POST /control` with `Authorization: Bearer
<token>`, where the token is the job's: HMAC-SHA256 of the job's uid under the operator's key,
so the operator needs to read no Secret to know it. The job's Secret `<job>-control` holds it
for the worker pods, which mount it at TOKEN_FILE.
"""

from __future__ import annotations

import hashlib
import hmac

CONTROL_KEY_ENV = "ELASTRAIN_CONTROL_KEY"
TOKEN_DIR = "/var/run/elastrain/control"
TOKEN_FILE = f"{TOKEN_DIR}/token"


def job_token(key: bytes, uid: str) -> str:
    """The control token of the job with this uid."""
    return hmac.new(key, uid.encode(), hashlib.sha256).hexdigest()


def secret_name(job: str) -> str:
    return f"{job}-control"
