"""Debian packages the harness needs beyond the base machine, installed with apt-get when their
program is missing (root only; otherwise a clear error), as the Prometheus test does. Standard
library only; used by hack/node (containerd, runc, CNI plugins, iptables) and hack/images (buildah,
debootstrap, gcc)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path


class PackageError(RuntimeError):
    """A needed package is missing and cannot be installed here."""


def missing_packages(programs: Mapping[str, str]) -> list[str]:
    """Packages (keys) whose program (value: a name on PATH, or an absolute path) is absent."""
    return sorted(pkg for pkg, program in programs.items()
                  if not (Path(program).exists() if program.startswith("/")
                          else shutil.which(program)))


def ensure_packages(programs: Mapping[str, str], *, why: str) -> None:
    missing = missing_packages(programs)
    if not missing:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise PackageError(f"{why} needs the Debian packages {missing}: run as root with "
                           f"apt-get, or install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]
    done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
        done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise PackageError(f"apt-get install {' '.join(missing)} failed:\n{done.stderr[-2000:]}")
