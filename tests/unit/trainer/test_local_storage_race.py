"""Two nodes sharing a file:// root (local mode, NFS) write and delete under the same directory
at once, as the checkpoint start-up check does: neither may fail on the other's cleanup."""

from __future__ import annotations

import threading
from pathlib import Path

from elastrain_trainer.checkpoint.local import LocalStorage


def test_concurrent_probe_writes_and_deletes_in_one_directory(tmp_path: Path) -> None:
    errors: list[BaseException] = []

    def node(name: str) -> None:
        storage = LocalStorage(tmp_path)  # each node opens the root itself
        try:
            for i in range(300):
                key = f".elastrain-check/{name}-{i}"
                storage.write(key, b"probe")
                assert storage.read(key) == b"probe"
                storage.delete([key])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=node, args=(n,)) for n in ("a", "b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert LocalStorage(tmp_path).list() == []
