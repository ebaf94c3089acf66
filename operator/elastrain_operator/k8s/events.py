"""Kubernetes Events about a TrainingJob, posted after the status write that they announce."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable
from datetime import UTC, datetime

from elastrain_operator.k8s.client import Kube, KubeError, Manifest, namespaced
from elastrain_operator.policy.status import EventSpec

log = logging.getLogger(__name__)
COMPONENT = "elastrain-operator"
MAX_MESSAGE = 1024
INSTANCE = os.environ.get("POD_NAME") or socket.gethostname()


def render_event(job: Manifest, event: EventSpec, now: datetime) -> Manifest:
    meta = job["metadata"]
    stamp = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": job["apiVersion"], "kind": job["kind"],
                           "name": meta["name"], "namespace": meta["namespace"],
                           "uid": meta["uid"]},
        "type": event.type,
        "reason": event.reason,
        "message": event.message[:MAX_MESSAGE],
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": INSTANCE,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def post_events(kube: Kube, job: Manifest, events: Iterable[EventSpec], now: datetime) -> None:
    """Best effort: an event that cannot be posted must not fail the reconcile. A Warning is
    also logged: the operator's log then says why it counted and replaced what it did after
    the job (and its Events) are gone."""
    for event in events:
        if event.type == "Warning":
            log.info("%s/%s: %s: %s", job["metadata"]["namespace"], job["metadata"]["name"],
                     event.reason, event.message[:MAX_MESSAGE])
        try:
            kube.create(namespaced("v1", job["metadata"]["namespace"], "events"),
                        render_event(job, event, now))
        except KubeError as err:
            log.warning("could not post event %s: %s", event.reason, err)
