"""The operator's NetworkPolicy settings, read from the environment once at startup.

The chart sets them (values `networkPolicy.*`); a bad value stops the operator at startup with a
message naming the variable, rather than rendering policies that admission refuses per job.

- ELASTRAIN_NETWORK_POLICY: "true" (default when unset) or "false": whether every job gets its
  NetworkPolicy (render.network). Off, the operator neither creates nor watches them.
- ELASTRAIN_NETWORK_POLICY_OPERATOR_PEER: one NetworkPolicyPeer (JSON) matching the operator's
  own pods, which poll the workers' /progress. Unset: the metrics/progress port is open to every
  source (render.network.MetricsPeers says why); the store and collective ports stay closed.
- ELASTRAIN_NETWORK_POLICY_SCRAPERS: a JSON list of NetworkPolicyPeer objects that may also
  scrape the metrics port (Prometheus). Unset: none.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from elastrain_operator.render.meta import Manifest
from elastrain_operator.render.network import MetricsPeers

ENABLED_VAR = "ELASTRAIN_NETWORK_POLICY"
OPERATOR_PEER_VAR = "ELASTRAIN_NETWORK_POLICY_OPERATOR_PEER"
SCRAPERS_VAR = "ELASTRAIN_NETWORK_POLICY_SCRAPERS"
PEER_KEYS = frozenset({"podSelector", "namespaceSelector", "ipBlock"})
SELECTOR_KEYS = frozenset({"matchLabels", "matchExpressions"})
SELECTOR_OPERATORS = frozenset({"In", "NotIn", "Exists", "DoesNotExist"})


@dataclass(frozen=True)
class NetworkPolicySettings:
    enabled: bool = True
    peers: MetricsPeers = field(default_factory=MetricsPeers)


def read_network_settings(env: Mapping[str, str] = os.environ) -> NetworkPolicySettings:
    """Raises ValueError naming the variable whose value is wrong."""
    enabled = _read_bool(env, ENABLED_VAR, default=True)
    operator = None
    if raw := env.get(OPERATOR_PEER_VAR, "").strip():
        operator = _check_peer(_load_json(OPERATOR_PEER_VAR, raw), OPERATOR_PEER_VAR)
    scrapers: tuple[Manifest, ...] = ()
    if raw := env.get(SCRAPERS_VAR, "").strip():
        value = _load_json(SCRAPERS_VAR, raw)
        if not isinstance(value, list):
            raise ValueError(f"{SCRAPERS_VAR} must be a JSON list of NetworkPolicyPeer "
                             f"objects, not {type(value).__name__}")
        scrapers = tuple(_check_peer(p, f"{SCRAPERS_VAR}[{i}]") for i, p in enumerate(value))
    return NetworkPolicySettings(enabled=enabled,
                                 peers=MetricsPeers(operator=operator, scrapers=scrapers))


def _read_bool(env: Mapping[str, str], name: str, *, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw not in ("true", "false"):
        raise ValueError(f"{name} must be \"true\" or \"false\", not {env[name]!r}")
    return raw == "true"


def _load_json(name: str, raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError as err:
        raise ValueError(f"{name} is not valid JSON ({err}): {raw[:200]!r}") from None


def _check_peer(peer: Any, where: str) -> Manifest:
    """The shape of a networking.k8s.io/v1 NetworkPolicyPeer; admission checks the rest."""
    if not isinstance(peer, dict) or not peer:
        raise ValueError(f"{where} must be a non-empty NetworkPolicyPeer object "
                         f"(podSelector, namespaceSelector and/or ipBlock), not {peer!r}")
    if unknown := sorted(set(peer) - PEER_KEYS):
        raise ValueError(f"{where} has unknown keys {unknown}; a NetworkPolicyPeer has "
                         f"{sorted(PEER_KEYS)}")
    if "ipBlock" in peer and len(peer) > 1:
        raise ValueError(f"{where}: ipBlock cannot be combined with selectors")
    if "ipBlock" in peer and not (isinstance(peer["ipBlock"], dict)
                                  and isinstance(peer["ipBlock"].get("cidr"), str)):
        raise ValueError(f"{where}.ipBlock needs a cidr string")
    for key in ("podSelector", "namespaceSelector"):
        if key in peer:
            _check_selector(peer[key], f"{where}.{key}")
    return dict(peer)


def _check_selector(selector: Any, where: str) -> None:
    if not isinstance(selector, dict):
        raise ValueError(f"{where} must be a label selector object, not {selector!r}")
    if unknown := sorted(set(selector) - SELECTOR_KEYS):
        raise ValueError(f"{where} has unknown keys {unknown}")
    labels = selector.get("matchLabels", {})
    if not isinstance(labels, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise ValueError(f"{where}.matchLabels must map strings to strings")
    expressions = selector.get("matchExpressions", [])
    if not isinstance(expressions, list) or not all(
            isinstance(e, dict) and isinstance(e.get("key"), str)
            and e.get("operator") in SELECTOR_OPERATORS for e in expressions):
        raise ValueError(f"{where}.matchExpressions must be a list of {{key, operator "
                         f"({'|'.join(sorted(SELECTOR_OPERATORS))}), values}}")
