"""The pause image: hack/images/pause.c compiled with `gcc -static -Os`, alone in one layer, run as
65532:65532 (the pod sandbox holds namespaces; it needs no privileges)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from hack.images.archive import write_archive
from hack.images.cache import capture, run

SOURCE = Path(__file__).resolve().parent / "pause.c"
CFLAGS = ("-static", "-Os", "-s", "-Wall", "-Wextra", "-Werror")
USER = "65532:65532"


def build_args() -> dict[str, str]:
    """What besides pause.c decides the binary: the compiler and its flags. Without gcc the hash
    matches no archive, so a build is attempted (and says gcc is missing)."""
    try:
        compiler = capture(["gcc", "--version"]).splitlines()[0]
    except FileNotFoundError:
        compiler = "gcc not found"
    return {"CC": compiler, "CFLAGS": " ".join(CFLAGS)}


def build_pause(dest: Path, *, ref: str, log_file: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="elastrain-pause-") as tmp:
        root = Path(tmp) / "rootfs"
        root.mkdir()
        run(["gcc", *CFLAGS, "-o", str(root / "pause"), str(SOURCE)], log_file=log_file)
        (root / "pause").chmod(0o755)
        write_archive(
            dest, ref=ref, root=root,
            config={"User": USER, "Entrypoint": ["/pause"], "WorkingDir": "/",
                    "Labels": {"org.opencontainers.image.title": "elastrain-pause"}},
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            comment="gcc -static -Os hack/images/pause.c",
        )
