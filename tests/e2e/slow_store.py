"""A TCP proxy that makes the object store slow: every response waits `delay` seconds.

It listens on the node's bridge address (pods reach it, nothing outside does) and forwards to
MinIO. Latency, not bandwidth: a save is a dozen requests in sequence (shards, DCP metadata,
manifest, commit marker, `latest`), so a fixed delay per response stretches it past 30 seconds
while each single request still answers well within boto3's 60-second read timeout (a bandwidth
cap let the client's socket buffer swallow a whole shard and then time out waiting). `delay`
may change while it runs: each response reads it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class SlowStoreProxy:
    def __init__(self, listen_host: str, target: tuple[str, int], delay: float) -> None:
        self.listen_host, self.target, self.delay = listen_host, target, delay
        self._listener = socket.create_server((listen_host, 0))
        self.port = int(self._listener.getsockname()[1])
        self._closed = False

    @property
    def endpoint(self) -> str:
        return f"http://{self.listen_host}:{self.port}"

    def __enter__(self) -> SlowStoreProxy:
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
            try:
                server = socket.create_connection(self.target, timeout=30)
                server.settimeout(None)
            except OSError:  # MinIO refused this one: the client sees a reset, the proxy stays
                client.close()
                continue
            awaiting = threading.Event()  # a request went out and its response has not begun
            threading.Thread(target=self._requests, args=(client, server, awaiting),
                             daemon=True).start()
            threading.Thread(target=self._responses, args=(server, client, awaiting),
                             daemon=True).start()

    def _requests(self, src: socket.socket, dst: socket.socket, awaiting: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                awaiting.set()
                dst.sendall(data)
        _close(src, dst)

    def _responses(self, src: socket.socket, dst: socket.socket,
                   awaiting: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if awaiting.is_set():
                    awaiting.clear()
                    time.sleep(self.delay)
                dst.sendall(data)
        _close(src, dst)


def _close(*sockets: socket.socket) -> None:
    for s in sockets:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
