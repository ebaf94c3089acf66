"""A TCP proxy that slows uploads to a fixed rate: a slow object store, as seen from the pods.

It listens on the node's bridge address (pods reach it, nothing outside does) and forwards to
MinIO. Bytes from client to server share one token bucket, so many parallel uploads together
never exceed `bytes_per_second`; responses pass unthrottled.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class ThrottlingProxy:
    def __init__(self, listen_host: str, target: tuple[str, int], bytes_per_second: int) -> None:
        self.listen_host, self.target, self.rate = listen_host, target, bytes_per_second
        self._listener = socket.create_server((listen_host, 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._next_free = time.monotonic()
        self._closed = False

    @property
    def endpoint(self) -> str:
        return f"http://{self.listen_host}:{self.port}"

    def __enter__(self) -> ThrottlingProxy:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _wait_for_budget(self, size: int) -> None:
        """Reserve `size` bytes of the shared budget and sleep until they are due."""
        with self._lock:
            start = max(self._next_free, time.monotonic())
            self._next_free = start + size / self.rate
        time.sleep(max(0.0, start - time.monotonic()))

    def _pipe(self, src: socket.socket, dst: socket.socket, throttled: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(8192 if throttled else 65536):
                if throttled:
                    self._wait_for_budget(len(data))
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
