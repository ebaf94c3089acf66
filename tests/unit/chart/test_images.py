"""The Dockerfiles keep their promises without a Docker engine to build them here: the operator
image installs only the operator extra (no torch), both images run as a numeric non-root user,
and the trainer image builds on any BASE_IMAGE with a CPU or CUDA torch."""

from __future__ import annotations

import re
import tomllib

from tests.unit.chart.chartlib import ROOT

OPERATOR = (ROOT / "Dockerfile").read_text()
TRAINER = (ROOT / "trainer_image" / "Dockerfile").read_text()


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(
        line for line in text.splitlines() if not line.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2).strip())
            for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", joined, re.M)]


def _final_stage(text: str) -> list[tuple[str, str]]:
    steps = _instructions(text)
    last_from = max(i for i, (op, _) in enumerate(steps) if op == "FROM")
    return steps[last_from:]


def _non_root_user(stage: list[tuple[str, str]]) -> str:
    users = [arg for op, arg in stage if op == "USER"]
    assert users, "the final stage sets no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "USER must be a numeric non-root UID (runAsNonRoot)"
    return uid


def test_operator_image_installs_the_operator_extra_only() -> None:
    installs = [command.strip() for op, arg in _instructions(OPERATOR) if op == "RUN"
                for command in arg.split("&&") if "pip install" in command]
    assert installs == ['/opt/venv/bin/pip install ".[operator]"']
    # The build fails if torch got in anyway (e.g. through a new dependency of the extra).
    assert any("find_spec('torch') is not None" in arg for op, arg in _instructions(OPERATOR))
    copied = " ".join(arg for op, arg in _instructions(OPERATOR) if op == "COPY")
    assert "trainer_image" not in copied
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert not [d for d in extras["operator"] if d.lower().startswith("torch")]


def test_operator_image_is_slim_and_non_root() -> None:
    first = next(arg for op, arg in _instructions(OPERATOR) if op == "ARG")
    assert re.search(r"python:3\.1[1-9][\w.-]*-slim", first)
    stage = _final_stage(OPERATOR)
    assert _non_root_user(stage) == "65532"  # the chart's podSecurityContext.runAsUser
    entry = next(arg for op, arg in stage if op == "ENTRYPOINT")
    assert "elastrain_operator" in entry


def test_trainer_image_builds_on_any_base_with_cpu_or_cuda_torch() -> None:
    steps = _instructions(TRAINER)
    assert steps[0][0] == "ARG" and steps[0][1].startswith("BASE_IMAGE=")
    # Every stage starts from BASE_IMAGE or from an earlier stage of this file (the final image
    # is built on the torch stage, so torch stays one cached layer).
    stages: list[str] = []
    for op, arg in steps:
        if op == "FROM":
            source = arg.split()[0]
            assert source == "${BASE_IMAGE}" or source in stages, arg
            stages.append(arg.split()[-1] if " AS " in arg.upper() else "")
    assert stages[0] == "torch" and len(stages) == 2
    assert any(op == "ARG" and arg.startswith("TORCH_VARIANT=cpu") for op, arg in steps)
    assert ("ARG", "TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}") in steps
    assert any('--index-url "${TORCH_INDEX_URL}"' in arg for op, arg in steps if op == "RUN")
    assert any('".[trainer]"' in arg for op, arg in steps if op == "RUN")
    _non_root_user(_final_stage(TRAINER))


def test_dockerignore_keeps_the_context_to_sources() -> None:
    rules = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.strip().startswith("#")]
    # Later rules win: only a leading `**` makes every other rule an exception to "nothing".
    assert rules[0] == "**", f"the first rule must ignore everything, not {rules[0]!r}"
    assert "**" not in rules[1:], "a second `**` would ignore the sources allowed before it"
    for allowed in ("!pyproject.toml", "!operator/elastrain_operator/**",
                    "!trainer_image/elastrain_trainer/**"):
        assert allowed in rules
