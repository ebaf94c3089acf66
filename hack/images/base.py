"""The Python base image (what `python:3.11-slim-bookworm` is to the Dockerfiles when no registry
is reachable): debootstrap --variant=minbase bookworm + python3, python3-venv and ca-certificates
from the Debian mirror, packed as a single-layer docker-archive by hack/images/archive.py.

debootstrap mounts /proc, /sys and (in a container) a tmpfs on dev/ with the host's device nodes
bound into it; a killed run can leave those mounts behind, so the tree is deleted only after every
mount below it is gone (deleting through a bind mount would delete host device nodes).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from hack.images.archive import LAYOUT_VERSION, write_archive
from hack.images.cache import BuildError, run

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
PACKAGES = ("python3", "python3-venv", "ca-certificates")
# Left out of the layer: package caches and lists (apt-get update refills them), logs.
PRUNE = ("var/cache/apt/archives", "var/lib/apt/lists", "var/cache/debconf", "var/log")


def build_args() -> dict[str, str]:
    return {"SUITE": SUITE, "MIRROR": MIRROR, "PACKAGES": ",".join(PACKAGES),
            "LAYOUT_VERSION": LAYOUT_VERSION}


def build_base(dest: Path, *, ref: str, log_file: Path) -> None:
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".base-"))
    root = tmp / "rootfs"
    try:
        run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}",
             SUITE, str(root), MIRROR], log_file=log_file)
        _prune(root)
        write_archive(
            dest, ref=ref, root=root,
            config={
                "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                        "LANG=C.UTF-8"],
                "Cmd": ["python3"],
                "Labels": {"org.opencontainers.image.title": "elastrain-base"},
            },
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            comment=f"debootstrap --variant=minbase --include={','.join(PACKAGES)} {SUITE}",
        )
    finally:
        unmount_below(root)  # raises while a mount stays: then the tree is left, not deleted
        shutil.rmtree(tmp)


def unmount_below(root: Path) -> None:
    """Unmounts everything mounted at or below root (deepest first); raises if any mount stays,
    so the caller never deletes
    through it."""
    for mount in sorted(mounts_below(root), key=lambda p: len(p.parts), reverse=True):
        subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)
    if left := mounts_below(root):
        raise BuildError(f"could not unmount {', '.join(map(str, left))}; not deleting {root}")


def mounts_below(root: Path) -> list[Path]:
    prefix = str(root.resolve()) if root.exists() else str(root)
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        target = line.split()[1].replace("\\040", " ")
        if target == prefix or target.startswith(prefix + "/"):
            found.append(Path(target))
    return found


def _prune(root: Path) -> None:
    for rel in PRUNE:
        path = root / rel
        if path.is_dir() and not path.is_symlink():
            for child in path.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
