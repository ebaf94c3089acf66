"""Entry of elastrain's launcher: torchrun with the agent patches of agent.py applied.

    python -m elastrain_trainer.launch [torchrun options] -m elastrain_trainer
    python -m elastrain_trainer.launch [torchrun options] train.py [script args]

Worker pods run this (the operator's default command; a TrainingJob's `command` may name it
too), and so does every local agent (cluster.py). Options and PET_* variables are torchrun's.
A torch whose agent internals changed stops the launcher with a message naming the hook and the
tested torch versions (exit code 1, also in the termination message); ELASTRAIN_PLAIN_TORCHRUN=1
runs plain torchrun instead, without the crash budget, the long restart saves and the notice to
the trainer alone (agent.py: a stop's SIGTERM would reach a DataLoader's workers too).

Configuration errors (faults.CONFIG_PREFIX, exit code EXIT_CONFIG) fail the job at once, with
no restart: a worker that reported one, a torch without the hooks above, and a command that
names a script, module or program that does not exist (checked before any worker starts:
python would exit 2 "can't open file", 1 "No module named", the agent raise FileNotFoundError).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from elastrain_trainer.faults import CONFIG_PREFIX, EXIT_CONFIG, config_reason
from elastrain_trainer.launch.agent import (
    StoreLost,
    WorkerCrashed,
    WorkerMisconfigured,
    left_cleanly,
    patch_crash_budget,
    patch_notice_to_trainer,
    patch_restart_timeout,
    report_crash,
)
from elastrain_trainer.private_hooks import PLAIN_TORCHRUN_ENV, MissingPrivateHook


def main(argv: list[str] | None = None) -> int:
    if os.environ.get(PLAIN_TORCHRUN_ENV) == "1":
        print(f"elastrain launch: {PLAIN_TORCHRUN_ENV}=1: plain torchrun; a worker's crash "
              "restarts in place up to --max-restarts, a restart SIGKILLs its workers "
              "after 30 s and a stop's SIGTERM reaches their DataLoader workers too",
              file=sys.stderr, flush=True)
    else:
        try:
            patch_restart_timeout()
            patch_crash_budget()
            patch_notice_to_trainer()
        except MissingPrivateHook as e:
            report_crash(f"{CONFIG_PREFIX}launcher: {e} (or set {PLAIN_TORCHRUN_ENV}=1 to run "
                         "plain torchrun without these patches)")
            return EXIT_CONFIG
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.run import main as torchrun
    from torch.distributed.run import parse_args

    args = parse_args(sys.argv[1:] if argv is None else argv)  # type: ignore[no-untyped-call]
    if missing := missing_entry(args.training_script, module=args.module,
                                no_python=args.no_python):
        report_crash(config_reason(missing))
        return EXIT_CONFIG
    try:
        torchrun(argv)
    except StoreLost as lost:  # in-process mode: ends the pod as a lost rendezvous does
        report_crash(str(lost))
        return 1
    except WorkerMisconfigured as error:
        report_crash(str(error))
        return EXIT_CONFIG
    except WorkerCrashed as crash:
        report_crash(str(crash))
        return 1
    except MissingPrivateHook as e:  # found only once the agent exists (agent.py)
        report_crash(f"{CONFIG_PREFIX}launcher: {e}")
        return EXIT_CONFIG
    except SignalException:
        # In-process recovery (docs/recovery.md section 10): the signalled worker left the job
        # at a step boundary and exited 0, so the pod ends 0 too. Restart mode: unchanged.
        if os.environ.get("ELASTRAIN_RECOVERY") == "inProcess" and left_cleanly():
            print("elastrain launch: signalled; the worker left the job cleanly", file=sys.stderr,
                  flush=True)
            sys.stdout.flush()
            # Not a normal interpreter exit: the signalled agent's C++ threads (its standalone
            # rendezvous) can abort finalization ("terminate called without an active
            # exception", seen once here), which would turn this exit 0 into SIGABRT.
            os._exit(0)
        raise
    return 0


def missing_entry(entry: str, *, module: bool = False, no_python: bool = False,
                  cwd: Path | None = None) -> str | None:
    """Why the workers' entry (torchrun's training_script) cannot start; None when it can."""
    if module:
        try:
            found = importlib.util.find_spec(entry) is not None
        except (ImportError, ValueError):  # a missing parent package, an empty name
            found = False
        return None if found else f"the command's module {entry!r} does not exist (-m {entry})"
    path = Path(entry) if cwd is None or Path(entry).is_absolute() else cwd / entry
    if no_python:
        if shutil.which(entry) or (os.sep in entry and os.access(path, os.X_OK)):
            return None
        return f"the command's program {entry!r} is not found (--no-python)"
    if path.is_file():
        return None
    return f"the command's script {entry!r} does not exist (in {cwd or Path.cwd()})"


if __name__ == "__main__":
    sys.exit(main())
