"""Keeping a new worker pod off the nodes that gave notice (policy.notices).

A replacement created while its slot's old pod still runs on a doomed node must land elsewhere:
a cordon or a NoSchedule taint already keeps the scheduler away, but a notice from the chart's
list may carry a weaker effect (PreferNoSchedule, or none yet). So the pod requires a node whose
`kubernetes.io/hostname` is none of them, ANDed into every term of the user's own required node
affinity (its terms are ORed: each keeps its meaning, minus the doomed nodes)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

HOSTNAME_LABEL = "kubernetes.io/hostname"


def avoiding(affinity: dict[str, Any] | None, nodes: Sequence[str]) -> dict[str, Any] | None:
    """`affinity` (the template's, untouched) with `nodes` excluded; as is without nodes."""
    if not nodes:
        return affinity
    out = copy.deepcopy(affinity) if affinity else {}
    node = out.setdefault("nodeAffinity", {})
    required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    exclude = {"key": HOSTNAME_LABEL, "operator": "NotIn", "values": sorted(set(nodes))}
    required["nodeSelectorTerms"] = [
        {**term, "matchExpressions": [*term.get("matchExpressions", []), exclude]}
        for term in terms]
    return out
