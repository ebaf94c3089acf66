"""hack/images/inputs.py: an image's input hash covers exactly the tracked files below its paths
(work-tree contents) and its build arguments; the build context holds exactly those files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hack.images.inputs import input_hash, stage_context  # noqa: E402

PATHS = ("Dockerfile", "src")
ARGS = {"BASE_IMAGE": "localhost/elastrain/base:0123456789ab"}


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A git repository whose index tracks Dockerfile, src/app.py and other/notes.txt."""
    tmp_path = tmp_path / "repo"
    (tmp_path / "src").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "Dockerfile").write_text("FROM scratch\n")
    (tmp_path / "src" / "app.py").write_text("print('hello')\n")
    (tmp_path / "other" / "notes.txt").write_text("not an input\n")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "add", "."], check=True)
    return tmp_path


def test_editing_a_tracked_input_changes_the_hash(repo: Path) -> None:
    before = input_hash(repo, PATHS, ARGS)
    (repo / "src" / "app.py").write_text("print('hello, world')\n")  # edited, not even staged
    assert input_hash(repo, PATHS, ARGS) != before


def test_the_executable_bit_of_a_tracked_input_counts(repo: Path) -> None:
    before = input_hash(repo, PATHS, ARGS)
    (repo / "src" / "app.py").chmod(0o755)
    assert input_hash(repo, PATHS, ARGS) != before


def test_an_untracked_file_does_not_change_the_hash(repo: Path) -> None:
    before = input_hash(repo, PATHS, ARGS)
    (repo / "src" / "scratch.py").write_text("untracked\n")
    (repo / "src" / "__pycache__").mkdir()
    (repo / "src" / "__pycache__" / "app.cpython-311.pyc").write_bytes(b"\0")
    assert input_hash(repo, PATHS, ARGS) == before


def test_a_tracked_file_outside_the_paths_does_not_change_the_hash(repo: Path) -> None:
    before = input_hash(repo, PATHS, ARGS)
    (repo / "other" / "notes.txt").write_text("edited\n")
    assert input_hash(repo, PATHS, ARGS) == before


def test_adding_a_file_to_git_changes_the_hash(repo: Path) -> None:
    before = input_hash(repo, PATHS, ARGS)
    (repo / "src" / "new.py").write_text("x = 1\n")
    subprocess.run(["git", "-C", str(repo), "add", "src/new.py"], check=True)
    assert input_hash(repo, PATHS, ARGS) != before


def test_build_args_change_the_hash(repo: Path) -> None:
    other = {"BASE_IMAGE": "localhost/elastrain/base:ba9876543210"}
    assert input_hash(repo, PATHS, other) != input_hash(repo, PATHS, ARGS)
    assert input_hash(repo, PATHS, {**ARGS, "TORCH_CUDA_LIBS": "0"}) != input_hash(
        repo, PATHS, ARGS)


def test_a_path_matching_no_tracked_file_is_an_error(repo: Path) -> None:
    with pytest.raises(ValueError, match="not tracked"):
        input_hash(repo, ("Dockerfile", "no-such-dir"), ARGS)


def test_the_build_context_holds_exactly_the_tracked_inputs(repo: Path, tmp_path: Path) -> None:
    (repo / "src" / "scratch.py").write_text("untracked\n")
    (repo / "src" / "app.py").write_text("edited in the work tree\n")
    context = tmp_path / "context"
    stage_context(repo, PATHS, context)
    files = sorted(p.relative_to(context).as_posix() for p in context.rglob("*") if p.is_file())
    assert files == ["Dockerfile", "src/app.py"]
    assert (context / "src" / "app.py").read_text() == "edited in the work tree\n"
