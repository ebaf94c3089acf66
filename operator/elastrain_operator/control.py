"""The operator's control channel to a job's trainers (issue 34, item 6).

Only the operator may change what a job's trainers do (today: the desired world of an in-process
job, which decides who trains and who waits as a spare). The trainers' /progress and /metrics
are read by scrapers too, and the NetworkPolicy opens the port to them, so a GET changes
nothing; control is `POST /control` with `Authorization: Bearer <token>`. The token is the
job's: HMAC-SHA256 of the job's uid under the operator's key, so the operator reads no Secret to
know it (it is granted none to read) and a token opens one job only. The operator creates the
Secret `<job>-control` (create only: it can overwrite nothing) with the first workers of each
round that creates any; the workers mount it at TOKEN_FILE and read it per request.

The key comes from ELASTRAIN_CONTROL_KEY (the chart keeps one in a Secret of its own, the same
across upgrades). Without it the operator makes one per process and says so: after a restart
its tokens no longer match the jobs' Secrets, and the trainers refuse it (the operator then
reads their progress read-only and warns; deleting a job's Secret lets the next pod it creates
bring a new one).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Mapping

log = logging.getLogger(__name__)
CONTROL_KEY_ENV = "ELASTRAIN_CONTROL_KEY"
MIN_KEY_CHARACTERS = 32


def load_key(environ: Mapping[str, str] = os.environ) -> bytes:
    """The operator's control key: ELASTRAIN_CONTROL_KEY, else one made for this process."""
    value = environ.get(CONTROL_KEY_ENV, "").strip()
    if len(value) >= MIN_KEY_CHARACTERS:
        return value.encode()
    if value:
        raise ValueError(f"{CONTROL_KEY_ENV} has {len(value)} characters; use at least "
                         f"{MIN_KEY_CHARACTERS} (the chart makes one of 64)")
    log.warning("%s is unset: this operator process made a control key of its own; in-process "
                "jobs' control tokens will not match after it restarts (the chart sets one)",
                CONTROL_KEY_ENV)
    return secrets.token_hex(32).encode()


def job_token(key: bytes, uid: str) -> str:
    """The control token of the job with this uid."""
    return hmac.new(key, uid.encode(), hashlib.sha256).hexdigest()
