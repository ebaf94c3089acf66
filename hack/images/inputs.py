"""An image's inputs and their hash: the files git tracks below the given repository paths (with
their working-tree contents, so an uncommitted edit counts) plus the build arguments. Untracked
files never count, and never reach a build either: `stage_context` copies exactly the hashed files
into the build context.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path


def tracked_files(repo: Path, paths: Sequence[str]) -> list[str]:
    """The files git tracks at or below each of `paths` (relative to repo), sorted; a path that
    matches no tracked file is an error (a typo would otherwise hash nothing)."""
    proc = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--error-unmatch", "--", *paths],
        capture_output=True, check=False,
    )
    if proc.returncode != 0:
        raise ValueError(f"not tracked by git in {repo}: {proc.stderr.decode().strip()}")
    return sorted({name for name in proc.stdout.decode().split("\0") if name})


def input_hash(repo: Path, paths: Sequence[str], args: Mapping[str, str]) -> str:
    """sha256 (hex) over each tracked file's name, executable bit and content (a symlink's target)
    below `paths`, then the sorted `args`. A tracked file deleted from the work tree hashes as
    missing."""
    digest = hashlib.sha256()
    for name in tracked_files(repo, paths):
        digest.update(f"file {len(name)} {name}\n".encode())
        digest.update(_describe(repo / name))
    for key in sorted(args):
        digest.update(f"arg {len(key)} {key} {len(args[key])} {args[key]}\n".encode())
    return digest.hexdigest()


def stage_context(repo: Path, paths: Sequence[str], dest: Path) -> None:
    """Copies the tracked files below `paths` (work-tree contents, modes kept) into dest."""
    for name in tracked_files(repo, paths):
        src, dst = repo / name, dest / name
        if not src.is_symlink() and not src.exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst, follow_symlinks=False)


def _describe(path: Path) -> bytes:
    if path.is_symlink():
        return f"symlink {os.readlink(path)}\n".encode()
    if not path.exists():
        return b"missing\n"
    executable = bool(path.stat().st_mode & 0o111)
    content = hashlib.sha256(path.read_bytes()).hexdigest()
    return f"{'exec' if executable else 'file'} {content}\n".encode()
