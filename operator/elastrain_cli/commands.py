"""What each `elastrain` subcommand does; __main__ only parses arguments."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import ValidationError

if TYPE_CHECKING:
    from elastrain_operator.model import TrainingJob


class UserError(Exception):
    """A mistake in the user's input: printed without a traceback, exit code 2."""


def parse_job(text: str, origin: str) -> TrainingJob:
    """Parse and validate a TrainingJob manifest with the same rules the CRD enforces."""
    from elastrain_operator.model import KIND, TrainingJob

    try:
        manifest = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise UserError(f"{origin}: not valid YAML: {err}") from err
    if not isinstance(manifest, dict) or manifest.get("kind") != KIND:
        raise UserError(f"{origin}: expected a manifest of kind {KIND}")
    try:
        return TrainingJob.model_validate(manifest)
    except ValidationError as err:
        raise UserError(f"{origin}: invalid TrainingJob:\n{format_errors(err)}") from err


def format_errors(err: ValidationError) -> str:
    """One line per problem, each naming the field as a kubectl user would write it."""
    lines = []
    for e in err.errors():
        path = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in e["loc"])
        path = path.replace(".[", "[")
        message = e["msg"].removeprefix("Value error, ")
        lines.append(f"  {path}: {message}" if path else f"  {message}")
    return "\n".join(lines)


def validate(text: str, origin: str) -> int:
    job = parse_job(text, origin)
    print(f"{origin}: TrainingJob {job.metadata.name} is valid")
    return 0


def crds() -> int:
    from elastrain_operator.render.crd import render_crd_yaml

    sys.stdout.write(render_crd_yaml())
    return 0


def run_local(text: str, origin: str, *, workers: int | None, simulate_preemption: bool,
              out: str | None, checkpoint_uri: str | None) -> int:
    raise UserError("local mode is not wired yet")


def estimate(text: str, origin: str, *, world_size: int | None) -> int:
    raise UserError("estimate is not wired yet")


def describe(name: str, namespace: str, kubeconfig: str | None) -> int:
    raise UserError("describe is not wired yet")


def operator(args: list[str]) -> int:
    from elastrain_operator.__main__ import main as operator_main

    result: Any = operator_main(args)
    return int(result or 0)
