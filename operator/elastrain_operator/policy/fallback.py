"""Checkpoint fallback: a resume that skipped a damaged checkpoint, told and kept in status.

Each trainer reports how its worker group's latest start resumed, in /progress, as
`"checkpointFallback": {"skippedStep": int, "skippedUri": str, "reason": str,
"loadedStep": int|null, "loadedUri": str|null, "stepsLost": int, "quarantined": bool,
"time": RFC3339}|null`: the newest committed checkpoint was proven damaged (a checksum mismatch,
a missing `.metadata`, a garbage manifest...) and skipped, and training resumed from an older one
(loadedStep) or, with none usable, from step 0 (null). A start that resumed normally reports
null; older trainers leave the field out.

The newest fallback seen is kept in status.checkpointFallback, so the lost work stays on record
after the next start reports null. A report is new when its (time, skippedUri) differs from the
stored one and it is not older: every rank of a group reports the same fallback, and a worker of
an earlier start must not bring an older one back. The CheckpointFallback condition is True from
the first fallback on (it records lost work; it never clears), its message describing the newest
one. Each new fallback is one Warning event (DamagedCheckpointSkipped; policy.status derives it
by comparing the written statuses), so it is announced once, however often the trainers are
polled and across operator restarts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from elastrain_operator.model import conditions as c
from elastrain_operator.model.status import CheckpointFallback

MAX_REASON = 600


def parse_checkpoint_fallback(raw: Any) -> CheckpointFallback | None:
    """The checkpointFallback of one /progress document; None when absent or malformed (the
    rest of the report still counts)."""
    if not isinstance(raw, dict):
        return None
    try:
        skipped, loaded = raw["skippedStep"], raw.get("loadedStep")
        lost = raw.get("stepsLost")
        if lost is None and isinstance(skipped, int):
            lost = skipped - (loaded if isinstance(loaded, int) else 0)
        return CheckpointFallback.model_validate({
            "skippedStep": skipped, "skippedUri": raw["skippedUri"],
            "reason": str(raw.get("reason") or "")[:MAX_REASON],
            "loadedStep": loaded, "loadedUri": raw.get("loadedUri"),
            "stepsLost": lost, "quarantined": raw.get("quarantined", False),
            "time": raw["time"]})
    except (KeyError, TypeError, ValueError, ValidationError):
        return None


def newest_fallback(stored: CheckpointFallback | None,
                    reported: Sequence[CheckpointFallback | None]) -> CheckpointFallback | None:
    """The fallback to store when the reports bring a new one; None: keep the stored one."""
    known = [f for f in reported if f is not None]
    if not known:
        return None
    newest = max(known, key=lambda f: (f.time, f.skipped_uri))
    if stored is not None and (newest.time, newest.skipped_uri) <= (stored.time,
                                                                     stored.skipped_uri):
        return None
    return newest


def describe_fallback(fb: CheckpointFallback) -> str:
    """One sentence: what was skipped and why, what training resumed from, what it cost."""
    loaded = ("no usable checkpoint left, started from step 0" if fb.loaded_step is None
              else f"resumed from step {fb.loaded_step}"
              + (f" ({fb.loaded_uri})" if fb.loaded_uri else ""))
    kept = ("quarantined (kept for a post-mortem, never loaded again)" if fb.quarantined
            else "not quarantined")
    return (f"at {fb.time.isoformat()} skipped the damaged checkpoint of step {fb.skipped_step} "
            f"({fb.skipped_uri}): {fb.reason or 'no reason reported'}; {loaded}; "
            f"{fb.steps_lost} step(s) lost; {kept}")


def fallback_condition(fb: CheckpointFallback | None) -> tuple[bool, str, str] | None:
    """(status, reason, message) of CheckpointFallback; None: no fallback ever, no condition."""
    if fb is None:
        return None
    return True, c.DAMAGED_CHECKPOINT_SKIPPED, describe_fallback(fb)
