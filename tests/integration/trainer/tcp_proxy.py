"""A TCP proxy the test controls: cut it to make the object store unreachable, then heal it;
or hold it, to keep requests from reaching the store until it is released.

Cutting closes the listener and every open connection, so clients see refused and reset
connections, as they would when the server's node disappears. Holding keeps every connection
open and parks each request that arrives (its request line is kept in `held`), so a checkpoint
save that starts meanwhile is provably in flight, and stays so, until `release()`.
Retargeting strands every open connection for good (nothing more forwarded either way, nothing
closed: the old server's node drops every packet) and sends new ones to another server, as a
Service's name leads to the pod that replaced one on a node gone dark.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading

REQUEST_LINE = re.compile(rb"^(GET|PUT|POST|DELETE|HEAD) (\S+) HTTP/1\.1")


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._flowing = threading.Event()
        self._flowing.set()
        self.held: list[str] = []  # "METHOD path" of each request that arrived while held
        self._stranded: set[socket.socket] = set()
        self._dark = threading.Event()  # never set: what a stranded connection waits on

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> TcpProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def cut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        if listener is not None:
            listener.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def heal(self) -> None:
        self.start()

    def hold(self) -> None:
        with self._lock:
            self.held = []
        self._flowing.clear()

    def release(self) -> None:
        self._flowing.set()

    def retarget(self, host: str, port: int) -> None:
        with self._lock:
            self.target = (host, port)
            self._stranded.update(self._conns)

    def _strand(self, sock: socket.socket) -> None:
        """A stranded connection's pipe stops here for good, forwarding and closing nothing."""
        with self._lock:
            stranded = sock in self._stranded
        if stranded:
            self._dark.wait()

    def _requests(self, src: socket.socket, dst: socket.socket) -> None:
        """Client to store, parking whatever arrives while held."""
        try:
            while data := src.recv(65536):
                self._strand(src)
                if not self._flowing.is_set():
                    if (line := REQUEST_LINE.match(data)) is not None:
                        with self._lock:
                            self.held.append(line.group(0).decode().removesuffix(" HTTP/1.1"))
                    self._flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        self._strand(src)
        _close(src, dst)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self._strand(src)
                dst.sendall(data)
        except OSError:
            pass
        self._strand(src)
        _close(src, dst)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self._conns += [client, upstream]
            threading.Thread(target=self._requests, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()


def _close(*sockets: socket.socket) -> None:
    for s in sockets:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
