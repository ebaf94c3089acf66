"""The image cache under $ELASTRAIN_CACHE/images: where archives and logs go, the machine-wide lock
per image, build-times.txt, and running a build step with its output in a log file.

    images/<name>-<hash12>.tar        finished docker-archives (named by their input hash)
    images/logs/<name>-<hash12>.log   the output of the build that made each one
    images/build-times.txt            one line per build: date, name, hash12, seconds
    images/.<name>.lock               flock held while an image is being built
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path


class BuildError(RuntimeError):
    """A build step failed; the message ends with the tail of its log."""


def cache_root() -> Path:
    return Path(os.environ.get("ELASTRAIN_CACHE", Path.home() / ".cache" / "elastrain"))


def images_dir() -> Path:
    path = cache_root() / "images"
    (path / "logs").mkdir(parents=True, exist_ok=True)
    return path


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] images: {message}", file=sys.stderr, flush=True)


@contextmanager
def locked(name: str) -> Iterator[None]:
    """Holds an exclusive flock on images/.<name>.lock: two builders of one image (a test session
    and `python3 -m hack.images build`) never run at once; the second waits, then finds the
    archive the first wrote."""
    with (images_dir() / f".{name}.lock").open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another build of {name}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def record_time(name: str, input_hash: str, seconds: float) -> None:
    line = f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {name} {input_hash[:12]} " \
           f"{seconds:.0f}\n"
    with (images_dir() / "build-times.txt").open("a") as out:
        out.write(line)


def run(argv: Sequence[str], *, log_file: Path, env: Mapping[str, str] | None = None,
        cwd: Path | None = None) -> None:
    """Runs argv, appending its output to log_file; raises BuildError with the log's tail."""
    with log_file.open("a") as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        proc = subprocess.run(list(argv), stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                              env={**os.environ, **env} if env else None, check=False)
    if proc.returncode != 0:
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-40:])
        raise BuildError(f"{argv[0]} failed (exit {proc.returncode}); {log_file}:\n{tail}")


def capture(argv: Sequence[str]) -> str:
    """stdout of argv (which must succeed), stripped."""
    return subprocess.run(list(argv), capture_output=True, text=True, check=True).stdout.strip()
