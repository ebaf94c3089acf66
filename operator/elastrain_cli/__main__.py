"""`elastrain`: the command line of elastrain.

    elastrain run [JOB.yaml] --local [--workers N] [--simulate-preemption] [--fresh]
                                     [--recovery Restart|InProcess]
    elastrain validate JOB.yaml          # the same checks the CRD applies, offline
    elastrain estimate [JOB.yaml] [--world-size N] [--device-memory 80GiB]
    elastrain describe NAME [-n NAMESPACE]
    elastrain operator [OPERATOR ARGS...]
    elastrain crds

The CLI is the one place allowed to use both the operator and the trainer packages; it imports
each lazily so that the operator image (no torch) can still run `elastrain operator`.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path
from typing import get_args

from elastrain_cli import commands
from elastrain_operator.model.status import RecoveryMode

RECOVERY_MODES: tuple[str, ...] = get_args(RecoveryMode)


def _job_source(path: str | None) -> tuple[str, str]:
    """(YAML text, where it came from): a file, or the embedded default job."""
    if path is None:
        text = resources.files("elastrain_cli").joinpath("default_job.yaml").read_text()
        return text, "embedded default job"
    try:
        return Path(path).read_text(), path
    except OSError as err:
        raise commands.UserError(f"cannot read {path}: {err.strerror}") from err


def _recovery_mode(text: str) -> str:
    """spec.recovery.mode's spelling, whatever the case typed."""
    modes = {mode.lower(): mode for mode in RECOVERY_MODES}
    if text.lower() not in modes:
        raise argparse.ArgumentTypeError(f"{text!r}: one of {', '.join(RECOVERY_MODES)}")
    return modes[text.lower()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastrain", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a TrainingJob; --local runs it on this machine")
    run.add_argument("job", nargs="?", help="TrainingJob YAML (default: the embedded demo job)")
    run.add_argument("--local", action="store_true", required=True,
                     help="run with torchrun workers on this machine (the only mode so far)")
    run.add_argument("--workers", type=int, help="local workers (default: spec.replicas)")
    run.add_argument("--simulate-preemption", action="store_true",
                     help="SIGTERM one worker mid-run and bring up a replacement")
    run.add_argument("--out", default=None, help="output directory (default: runs/<job name>)")
    run.add_argument("--checkpoint-uri", default=None,
                     help="override spec.checkpoint.uri (e.g. s3://bucket/prefix)")
    run.add_argument("--fresh", action="store_true",
                     help="start over from step 0: delete this job's earlier local outputs and "
                          "file:// checkpoints; remote ones are kept and not resumed")
    run.add_argument("--recovery", type=_recovery_mode, metavar="|".join(RECOVERY_MODES),
                     help="spec.recovery.mode for this run (default: the job's, else what the "
                          "operator picks for it: InProcess where the job can run it)")

    validate = sub.add_parser("validate", help="check a TrainingJob YAML offline")
    validate.add_argument("job")

    estimate = sub.add_parser("estimate", help="memory needed per worker for a TrainingJob")
    estimate.add_argument("job", nargs="?")
    estimate.add_argument("--world-size", type=int, default=None,
                          help="workers x processes (default: spec.replicas x nprocPerNode)")
    estimate.add_argument("--device-memory", default=None, metavar="SIZE",
                          help="memory of one rank's device (GPU, or host RAM per rank for a "
                          "CPU job), e.g. 80GiB: says whether the job fits and, if not, which "
                          "knob makes it fit; exit 1 when it does not fit")

    describe = sub.add_parser("describe", help="a job's workers, restarts and checkpoints")
    describe.add_argument("name")
    describe.add_argument("-n", "--namespace", default="default")
    describe.add_argument("--kubeconfig", default=None)

    # Every argument after `operator` is the operator's own (argparse.REMAINDER cannot pass
    # options such as --standalone through a subparser): see parse().
    sub.add_parser("operator", add_help=False,
                   help="run the operator; its options pass through (elastrain operator --help)")

    sub.add_parser("crds", help="print the TrainingJob CRD")
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; `operator` gets every argument after it in `args.args`, unparsed."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "operator":
        args.args = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        if args.command == "run":
            text, origin = _job_source(args.job)
            return commands.run_local(text, origin, workers=args.workers,
                                      simulate_preemption=args.simulate_preemption,
                                      out=args.out, checkpoint_uri=args.checkpoint_uri,
                                      fresh=args.fresh, recovery=args.recovery)
        if args.command == "validate":
            text, origin = _job_source(args.job)
            return commands.validate(text, origin)
        if args.command == "estimate":
            text, origin = _job_source(args.job)
            return commands.estimate(text, origin, world_size=args.world_size,
                                     device_memory=args.device_memory)
        if args.command == "describe":
            return commands.describe(args.name, args.namespace, args.kubeconfig)
        if args.command == "operator":
            return commands.operator(args.args)
        if args.command == "crds":
            return commands.crds()
    except commands.UserError as err:
        print(f"elastrain: {err}", file=sys.stderr)
        return 2
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
