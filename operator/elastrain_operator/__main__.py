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
import random
import sys
from collections.abc import Sequence

import kopf

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
    except ValueError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    import elastrain_operator.handlers as handlers  # registers the handlers with kopf

    if network.enabled:
        handlers.watch_network_policies()

    clusterwide = args.all_namespaces or not args.namespace
    priority = args.priority if args.priority is not None else random.randint(1, 1_000_000)
    options = RuntimeOptions(
        standalone=args.standalone, peering_name=args.peering, priority=priority,
        clusterwide=clusterwide, namespaces=list(args.namespace),
        metrics_port=args.metrics_port, peering_lifetime_seconds=args.peering_lifetime,
        network=network)
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


if __name__ == "__main__":
    raise SystemExit(main())
