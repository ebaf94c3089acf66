"""`python -m elastrain_operator`: run the operator (kopf) with elastrain's handlers.

    python -m elastrain_operator --standalone --namespace ml         # one replica, dev
    python -m elastrain_operator --all-namespaces --priority 100 \\
        --liveness http://0.0.0.0:8080/healthz --metrics-port 9090      # in a Deployment

With peering (the default), replicas elect by priority through a KopfPeering object: the one
with the highest priority acts, the others pause until its record expires. Without --priority a
random one is drawn, so two replicas never tie (a tie pauses both).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
from collections.abc import Sequence

import kopf

from elastrain_operator.k8s.nodes import nodes_readable, read_notice_settings
from elastrain_operator.network_settings import read_network_settings
from elastrain_operator.startup import OperatorState, RuntimeOptions


def build_parser(prog: str = "python -m elastrain_operator") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog,
                                     description="Run the elastrain TrainingJob operator.")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[],
                       help="watch this namespace (repeatable; globs allowed)")
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="watch every namespace (the default when no --namespace)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--standalone", action="store_true",
                      help="no peering: for development and single-replica installs")
    mode.add_argument("--peering", default="elastrain", metavar="NAME",
                      help="peering object name shared by the replicas (default: elastrain)")
    parser.add_argument("--priority", type=int, default=None,
                        help="peering priority; the highest acts (default: random)")
    parser.add_argument("--peering-lifetime", type=int, default=60, metavar="SECONDS",
                        help="how long a silent peer still counts as alive")
    parser.add_argument("--liveness", default=None, metavar="URL",
                        help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus /metrics on this port (0: off)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    return parser


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m elastrain_operator") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        network = read_network_settings()
        notice_taints = read_notice_settings(os.environ)
    except ValueError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    import elastrain_operator.handlers as handlers  # registers the handlers with kopf

    if network.enabled:
        handlers.watch_network_policies()
    notices_off = ""
    if notice_taints is not None and (why := _nodes_unreadable()) is not None:
        logging.getLogger("elastrain_operator").warning("node notices are off: %s", why)
        notice_taints, notices_off = None, why
    if notice_taints is not None:
        handlers.watch_nodes()
    kueue = _kueue_on(os.environ) and _kueue_served()
    kueue_yield = kueue and _kueue_yield_on(os.environ)
    if kueue:
        handlers.watch_kueue(yielding=kueue_yield)

    clusterwide = args.all_namespaces or not args.namespace
    priority = args.priority if args.priority is not None else random.randint(1, 1_000_000)
    options = RuntimeOptions(
        standalone=args.standalone, peering_name=args.peering, priority=priority,
        clusterwide=clusterwide, namespaces=list(args.namespace),
        metrics_port=args.metrics_port, peering_lifetime_seconds=args.peering_lifetime,
        network=network, notice_taints=notice_taints, notices_off=notices_off,
        kueue_served=kueue, kueue_yield=kueue_yield,
        kueue_slices=kueue and _kueue_slices_on(os.environ))
    kopf.configure(verbose=args.verbose, log_prefix=True)
    logging.getLogger("elastrain_operator").setLevel(
        logging.DEBUG if args.verbose else logging.INFO)
    if not args.verbose:  # kopf logs every handler success; the tickers alone make that noise
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    kopf.run(
        standalone=args.standalone,
        peering_name=None if args.standalone else args.peering,
        priority=priority,
        clusterwide=clusterwide,
        namespaces=list(args.namespace),
        liveness_endpoint=args.liveness,
        memo=kopf.Memo(options=options, state=OperatorState()),
    )
    return 0


def _kueue_on(env: os._Environ[str] | dict[str, str]) -> bool:
    """The chart's kueue.enabled (ELASTRAIN_KUEUE, default true): false ignores Kueue."""
    return env.get("ELASTRAIN_KUEUE", "true").strip().lower() != "false"


def _kueue_yield_on(env: os._Environ[str] | dict[str, str]) -> bool:
    """The chart's kueue.yieldQuota (ELASTRAIN_KUEUE_YIELD, default true): false keeps every
    admitted worker however urgent a Workload waits (policy.kueue_yield)."""
    return env.get("ELASTRAIN_KUEUE_YIELD", "true").strip().lower() != "false"


def _kueue_slices_on(env: os._Environ[str] | dict[str, str]) -> bool:
    """The chart's kueue.workloadSlices (ELASTRAIN_KUEUE_SLICES, default false): true where
    Kueue's ElasticJobsViaWorkloadSlices gate is on, so a job grows by slices of its Workload
    (policy.kueue_slices) rather than by an extra Workload (policy.kueue_grow)."""
    return env.get("ELASTRAIN_KUEUE_SLICES", "false").strip().lower() == "true"


def _kueue_served() -> bool:
    """Whether the cluster serves Kueue's v1beta2 API: its Workloads are then watched, and jobs
    that name a queue wait for admission (k8s.kueue). Kueue installed later needs a restart."""
    from elastrain_operator.k8s.client import Kube, load_api_client
    from elastrain_operator.k8s.kueue import kueue_served
    try:
        api = load_api_client()
    except Exception as err:  # no credentials yet: kopf's login says so
        logging.getLogger("elastrain_operator").debug("Kueue probe skipped: %s", err)
        return False
    try:
        served = kueue_served(Kube(api))
    finally:
        api.close()  # type: ignore[no-untyped-call]
    logging.getLogger("elastrain_operator").info(
        "Kueue's %s API %s", "kueue.x-k8s.io/v1beta2", "served: jobs that name a queue wait "
        "for its admission" if served else "not served: a job that names a queue waits")
    return served


def _nodes_unreadable() -> str | None:
    """Why the operator may not read nodes, or None (a failure of another kind: the watch's
    own retries deal with it)."""
    from elastrain_operator.k8s.client import Kube, load_api_client
    try:
        api = load_api_client()
    except Exception as err:  # no credentials yet: kopf's login says so, notices stay on
        logging.getLogger("elastrain_operator").debug("node probe skipped: %s", err)
        return None
    try:
        return nodes_readable(Kube(api))
    except Exception as err:
        logging.getLogger("elastrain_operator").debug("node probe failed: %s", err)
        return None
    finally:
        api.close()  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    raise SystemExit(main())
