"""file:// checkpoint storage: one file per key under a root directory."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from elastrain_trainer.checkpoint.problems import Explanation, explain_os_error


class LocalStorage:
    """Keys map to files under `root`; writes go to a temp file, fsync, then rename."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()

    @property
    def uri(self) -> str:
        return f"file://{self.root}"

    def explain_error(self, error: BaseException, action: str) -> Explanation:
        return explain_os_error(error)

    def describe_access(self) -> str:
        return f"as uid {os.getuid()}"

    def _path(self, key: str) -> Path:
        return self.root / key

    def write(self, key: str, data: bytes | bytearray | memoryview) -> None:
        path = self._path(key)
        for attempt in range(5):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.",
                                           suffix=".tmp")
                break
            except (FileNotFoundError, FileExistsError):
                # Another node's delete() removed the directory as it emptied (two nodes
                # sharing a root, as local mode and NFS do): make it again.
                if attempt == 4:
                    raise
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        # The rename is durable only once the directory entry is.
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def read(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        if not self.root.is_dir():
            return []
        keys = []
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if name.endswith(".tmp") and name.startswith("."):
                    continue  # an in-flight write, not an object yet
                key = Path(dirpath, name).relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, keys: Iterable[str]) -> None:
        parents = set()
        for key in keys:
            path = self._path(key)
            path.unlink(missing_ok=True)
            parents.add(path.parent)
        for parent in parents:
            # Empty checkpoint directories are noise for humans listing the root.
            # Another node may be writing into it or removing it at the same moment: gone, or
            # no longer empty, are both fine.
            if parent != self.root:
                with contextlib.suppress(OSError):
                    if not any(parent.iterdir()):
                        parent.rmdir()
