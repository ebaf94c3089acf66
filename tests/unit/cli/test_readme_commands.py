"""Every command line README.md documents parses as written, and its program answers --help
(a mere mention, `elastrain describe`, only the latter).

`elastrain ...` and `python -m elastrain_operator ...` go through the real argument parsers, all
the way into the operator's own for `elastrain operator`; the hack/ scripts answer --help after
their documented arguments. (tests/integration/cli/test_readme_operator.py starts the documented
operator commands against the real apiserver.)
"""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from elastrain_cli.__main__ import parse
from elastrain_operator.__main__ import build_parser as operator_parser
from tests.unit.cli.readme import ROOT, documented_commands, executable, is_mention

COMMANDS = documented_commands()
OPERATOR = ["--standalone", "-n", "ml"]


def strictly(parser_call: Any, *args: Any) -> Any:
    """Call an argparse parse; its usage error (SystemExit) fails the test with its message."""
    try:
        return parser_call(*args)
    except SystemExit as err:
        pytest.fail(f"argument parsing refused {args}: exit {err.code}")


def test_readme_documents_both_ways_to_run_the_operator() -> None:
    assert ["python", "-m", "elastrain_operator", *OPERATOR] in COMMANDS
    assert ["elastrain", "operator", *OPERATOR] in COMMANDS
    assert {c[1] for c in COMMANDS if c[0] == "elastrain"} >= {"validate", "estimate", "run",
                                                               "describe", "operator"}


@pytest.mark.parametrize("argv", [c for c in COMMANDS if not is_mention(c) and (
    c[0] == "elastrain" or c[:3] == ["python", "-m", "elastrain_operator"])], ids=" ".join)
def test_documented_command_parses(argv: list[str]) -> None:
    if argv[0] == "elastrain":
        args = strictly(parse, argv[1:])
        assert args.command == argv[1]
        if args.command != "operator":
            return
        forwarded = args.args
    else:
        forwarded = argv[3:]
    options = strictly(operator_parser().parse_args, forwarded)
    assert options.standalone and options.namespace == ["ml"], options


def test_elastrain_operator_passes_every_option_through() -> None:
    args = parse(["operator", "-A", "--peering", "ha", "--priority", "7", "--liveness",
                  "http://0.0.0.0:8080/healthz", "--metrics-port", "9090", "-v"])
    assert args.args == ["-A", "--peering", "ha", "--priority", "7", "--liveness",
                         "http://0.0.0.0:8080/healthz", "--metrics-port", "9090", "-v"]
    with pytest.raises(SystemExit):
        parse(["validate", "job.yaml", "--standalone"])  # other commands stay strict


def _programs() -> list[list[str]]:
    """One documented command per program and subcommand (elastrain's are per subcommand)."""
    seen: dict[tuple[str, ...], list[str]] = {}
    for argv in COMMANDS:
        key = tuple(argv[:2] if argv[0] == "elastrain" else argv[:3] if "-m" in argv else argv[:2])
        seen.setdefault(key, argv)
    return list(seen.values())


@pytest.mark.parametrize("argv", _programs(), ids=" ".join)
def test_documented_command_answers_help(argv: list[str]) -> None:
    done = subprocess.run([*executable(argv), "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: "), done.stdout
    if argv[:2] == ["elastrain", "operator"]:
        assert "usage: elastrain operator" in done.stdout and "--standalone" in done.stdout
