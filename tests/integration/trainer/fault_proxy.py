"""An HTTP/1.1 proxy for tests that injects an object store's faults on message boundaries.

It sits between boto3 (the trainer) and the real MinIO, on loopback only, and parses both
directions just enough to know where each request and response starts and ends: Content-Length
and chunked bodies, bodyless responses (HEAD, 1xx, 204, 304) and `Expect: 100-continue`.
botocore's aws-chunked uploads arrive as HTTP chunks (urllib3's) whose payload has aws-chunked
framing of its own; a flip lands in the data of that inner framing too. Bodies stream through
in pieces of at most 64 KiB; nothing is buffered whole. With `Fault()` it forwards every byte
unchanged.

`set(Fault(...))` switches the fault for everything from then on:
- `reset_response_over`: a response with a longer body gets that many body bytes, then RST;
- `slowdown_every`: every k-th request is answered here with S3's 503 SlowDown;
- `delay_seconds`: each request waits before it is forwarded;
- `refuse`: every connection, open or new, is reset (whatever `path` says);
- `flip_request_byte`: the next N request bodies (of at least 1 KiB) get one payload byte XORed.
Request counts for `slowdown_every`, and the flips left, start afresh with each `set`.

The proxy assumes clients do not pipeline (urllib3 never does): a request that the proxy answers
itself is answered when it arrives, after the response to the one before.
"""

from __future__ import annotations

import contextlib
import fcntl
import queue
import re
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from xml.sax.saxutils import escape

PIECE = 64 * 1024  # the most bytes read or sent at once
MAX_HEAD = 64 * 1024  # a request or response head longer than this breaks the connection
FLIP_MIN = 1024  # bodies (or aws-chunked chunks) shorter than this are never flipped
CHUNKED = -1  # body framings besides a length: chunked, or until the sender closes
UNTIL_CLOSE = -2
STATS = ("connections", "requests", "responses", "resets", "slowdowns", "refused", "flipped",
         "delayed")


@dataclass(frozen=True)
class Fault:
    """What the proxy does to the traffic; `Fault()` passes everything through."""

    reset_response_over: int | None = None  # body bytes forwarded before RST of longer responses
    slowdown_every: int = 0  # k: every k-th matching request gets 503 SlowDown; 0: off
    delay_seconds: float = 0.0  # each matching request waits this long before it is forwarded
    refuse: bool = False  # reset open connections and every new one
    flip_request_byte: int = 0  # the next N matching request bodies get one byte XORed with 0xFF
    path: str = ""  # a regex searched in the request-target (path+query); "" matches every request


class _Broken(Exception):
    """The peer closed mid-message or sent something that is not HTTP/1.1."""


class _Reader:
    """Buffered reads from a socket: lines for heads and framing, pieces for bodies."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()

    def readline(self) -> bytes | None:
        """One line with its line ending; None when the peer closed before sending any byte."""
        while (end := self._buf.find(b"\n")) < 0:
            if len(self._buf) > MAX_HEAD:
                raise _Broken("line too long")
            data = self._sock.recv(PIECE)
            if not data:
                if self._buf:
                    raise _Broken("closed mid-line")
                return None
            self._buf += data
        line = bytes(self._buf[:end + 1])
        del self._buf[:end + 1]
        return line

    def read_some(self, limit: int) -> bytes:
        """1 to `limit` bytes; b"" when the peer closed."""
        if not self._buf:
            return self._sock.recv(min(limit, PIECE))
        data = bytes(self._buf[:limit])
        del self._buf[:limit]
        return data


@dataclass(frozen=True)
class _Head:
    raw: bytes  # the start line, the header lines and the blank line, exactly as received
    start: str  # the start line without its line ending
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value


def _line(reader: _Reader) -> bytes:
    line = reader.readline()
    if line is None:
        raise _Broken("closed mid-message")
    return line


def _read_head(reader: _Reader) -> _Head | None:
    """The next message head; None when the peer closed cleanly between messages."""
    first = reader.readline()
    while first in (b"\r\n", b"\n"):  # a stray empty line before a start line is allowed
        first = reader.readline()
    if first is None:
        return None
    lines = [first]
    while lines[-1] not in (b"\r\n", b"\n"):
        lines.append(_line(reader))
        if sum(map(len, lines)) > MAX_HEAD:
            raise _Broken("head too long")
    headers = {}
    for line in lines[1:-1]:
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return _Head(b"".join(lines), first.decode("latin-1").rstrip("\r\n"), headers)


def _framing(head: _Head, *, bodyless: bool, default: int) -> int:
    """The body's length, CHUNKED or UNTIL_CLOSE (`default` when the head says nothing)."""
    if bodyless:
        return 0
    encodings = [e.strip().lower() for e in head.headers.get("transfer-encoding", "").split(",")]
    if encodings[-1] == "chunked":
        return CHUNKED
    if "content-length" in head.headers:
        try:
            return int(head.headers["content-length"])
        except ValueError as err:
            raise _Broken("bad Content-Length") from err
    return default


class _Flip:
    """Picks the one payload byte (the body without HTTP's chunk framing) of a request to flip,
    and flips it as the payload streams by.

    An aws-chunked payload has chunk framing of its own (size lines, a trailer); the byte is in
    the middle of its first chunk of at least FLIP_MIN data bytes. Otherwise it is the middle of
    a Content-Length body, or of the first HTTP chunk that is large enough. `claim` is asked once
    such a place is found: it says whether this request still gets a flip."""

    def __init__(self, claim: Callable[[], bool], *, aws_chunked: bool,
                 length: int | None) -> None:
        self._claim = claim
        self._aws_chunked = aws_chunked
        self.target: int | None = None
        self._decided = False
        self._line = bytearray()  # an aws-chunked size line so far
        self._skip = 0  # aws-chunked bytes (a small chunk's data and CRLF) before the next line
        if not aws_chunked and length is not None:
            self._decide(length // 2 if length >= FLIP_MIN else None)

    def _decide(self, target: int | None) -> None:
        self._decided = True
        if target is not None and self._claim():
            self.target = target

    def on_chunk(self, size: int, offset: int) -> None:
        """An HTTP chunk of `size` data bytes starts at payload offset `offset`."""
        if not self._decided and not self._aws_chunked and size >= FLIP_MIN:
            self._decide(offset + size // 2)

    def apply(self, data: bytes, offset: int) -> bytes:
        """`data`, the payload from `offset` on, with the chosen byte flipped if it is here."""
        if not self._decided and self._aws_chunked:
            self._scan(data, offset)
        if self.target is None or not offset <= self.target < offset + len(data):
            return data
        flipped = bytearray(data)
        flipped[self.target - offset] ^= 0xFF
        return bytes(flipped)

    def _scan(self, data: bytes, offset: int) -> None:
        """Follow the aws-chunked framing until the first chunk large enough to flip in."""
        i = 0
        while not self._decided and i < len(data):
            if self._skip:
                step = min(self._skip, len(data) - i)
                self._skip -= step
                i += step
                continue
            end = data.find(b"\n", i)
            self._line += data[i:] if end < 0 else data[i:end + 1]
            if end < 0:
                if len(self._line) > MAX_HEAD:
                    self._decide(None)
                return
            i = end + 1
            try:
                size = int(bytes(self._line).split(b";", 1)[0].strip(), 16)
            except ValueError:
                size = 0  # not aws-chunked after all: flip nothing
            self._line.clear()
            if size == 0 or size >= FLIP_MIN:
                self._decide(offset + i + size // 2 if size else None)
            else:
                self._skip = size + 2


def _copy_length(reader: _Reader, size: int, send: Callable[[bytes], None],
                 flip: _Flip | None = None, offset: int = 0) -> None:
    """Forward exactly `size` bytes, which are the payload's from `offset` on."""
    done = 0
    while done < size:
        data = reader.read_some(min(PIECE, size - done))
        if not data:
            raise _Broken("closed mid-body")
        send(data if flip is None else flip.apply(data, offset + done))
        done += len(data)


def _copy_chunked(reader: _Reader, send: Callable[[bytes], None], *,
                  flip: _Flip | None = None, limit: int | None = None) -> bool:
    """Forward a chunked body with its trailer; True when it was cut after `limit` data bytes.
    Only chunk data is ever flipped, never a size line or the trailer."""
    sent = 0
    while True:
        size_line = _line(reader)
        try:
            size = int(size_line.split(b";", 1)[0].strip(), 16)
        except ValueError as err:
            raise _Broken("bad chunk size") from err
        send(size_line)
        if size == 0:
            break
        if limit is not None and sent + size > limit:
            _copy_length(reader, limit - sent, send)
            return True
        if flip is not None:
            flip.on_chunk(size, sent)
        _copy_length(reader, size, send, flip, sent)
        sent += size
        send(_line(reader))  # the CRLF after the chunk's data
    while (trailer := _line(reader)) not in (b"\r\n", b"\n"):
        send(trailer)
    send(trailer)
    return False


def _copy_until_close(reader: _Reader, send: Callable[[bytes], None], limit: int | None) -> bool:
    """Forward until the sender closes; True when it was cut after `limit` bytes."""
    sent = 0
    while data := reader.read_some(PIECE):
        if limit is not None and sent + len(data) > limit:
            send(data[:limit - sent])
            return True
        send(data)
        sent += len(data)
    return False


def _slowdown(target: str, *, head_only: bool) -> bytes:
    """S3's 503 SlowDown response to the request for `target`."""
    body = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
            "<Message>Please reduce your request rate.</Message>"
            f"<Resource>{escape(target)}</Resource><RequestId>fault-proxy</RequestId>"
            "</Error>").encode()
    head = ("HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nx-amz-request-id: fault-proxy\r\n"
            "Connection: keep-alive\r\n\r\n").encode()
    return head if head_only else head + body


def _wait_delivered(sock: socket.socket, timeout: float = 2.0) -> None:
    """Wait (bounded) until the peer's kernel has acknowledged everything sent, so that a reset
    which follows does not discard bytes already forwarded (Linux's SIOCOUTQ)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            unsent = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ,
                                                    b"\0\0\0\0"))[0]
        except OSError:
            return
        if unsent == 0:
            return
        time.sleep(0.005)


def _rst(sock: socket.socket) -> None:
    """Close with SO_LINGER 0, so the peer gets RST instead of FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class _Conn:
    """One client connection and its own upstream one; closed (or reset) once."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client, self.upstream = client, upstream
        self.pending: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()  # method, target
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._closed = False

    def send_client(self, data: bytes) -> None:
        with self._send_lock:
            self.client.sendall(data)

    def close(self, *, reset: bool = False) -> bool:
        """Close both sockets (RST with `reset`); False when they were closed already."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
        for sock in (self.client, self.upstream):
            # Shutting down wakes this connection's other thread from recv; SHUT_RD sends nothing,
            # so with `reset` the peer's first news is the RST of the close.
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RD if reset else socket.SHUT_RDWR)
            if reset:
                _rst(sock)
            else:
                sock.close()
        return True


class FaultProxy:
    """Listens on 127.0.0.1 (an ephemeral port) and forwards to target_host:target_port."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._conns: set[_Conn] = set()
        self._stopped = threading.Event()
        self._fault = Fault()
        self._pattern: re.Pattern[str] | None = None
        self._matched = 0  # requests matching the fault's path since it was set
        self._flips_left = 0
        self._stats = dict.fromkeys(STATS, 0)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def stats(self) -> dict[str, int]:
        """Counts since start: connections proxied, requests seen, the store's final responses
        forwarded whole, and each fault's doings (`refused`: connections reset by `refuse`;
        `resets`: responses cut short)."""
        with self._lock:
            return dict(self._stats)

    def start(self) -> FaultProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._stopped.clear()
        threading.Thread(target=self._accept, args=(listener,), daemon=True,
                         name=f"fault-proxy-{self.port}").start()
        return self

    def stop(self) -> None:
        self._stopped.set()  # wakes delayed requests
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
            listener.close()
        for conn in conns:
            conn.close()

    def set(self, fault: Fault) -> None:
        pattern = re.compile(fault.path) if fault.path else None
        with self._lock:
            self._fault, self._pattern = fault, pattern
            self._matched, self._flips_left = 0, fault.flip_request_byte
            open_conns = list(self._conns) if fault.refuse else []
        for conn in open_conns:
            if conn.close(reset=True):
                self._count("refused")

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _count(self, name: str) -> None:
        with self._lock:
            self._stats[name] += 1

    def _claim_flip(self) -> bool:
        with self._lock:
            if self._flips_left <= 0:
                return False
            self._flips_left -= 1
            self._stats["flipped"] += 1
            return True

    def _active(self, target: str) -> tuple[Fault, bool]:
        """The fault now, and whether a request for `target` matches its path."""
        with self._lock:
            fault, pattern = self._fault, self._pattern
        return fault, pattern is None or pattern.search(target) is not None

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            if self._fault.refuse:
                self._count("refused")
                _rst(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _rst(client)
                continue
            upstream.settimeout(None)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(client, upstream)
            with self._lock:
                if self._listener is not listener:
                    conn.close()
                    return
                self._conns.add(conn)
                self._stats["connections"] += 1
            for pump in (self._requests, self._responses):
                threading.Thread(target=pump, args=(conn,), daemon=True).start()

    def _drop(self, conn: _Conn, *, reset: bool = False) -> None:
        with self._lock:
            self._conns.discard(conn)
        conn.close(reset=reset)

    def _requests(self, conn: _Conn) -> None:
        """Client to upstream, one request at a time."""
        reader = _Reader(conn.client)
        try:
            while (head := _read_head(reader)) is not None:
                self._request(conn, reader, head)
            conn.upstream.shutdown(socket.SHUT_WR)  # the responses still come back
        except (OSError, _Broken):
            self._drop(conn)

    def _request(self, conn: _Conn, reader: _Reader, head: _Head) -> None:
        method, target, *_ = [*head.start.split(" "), "", ""]
        self._count("requests")
        fault, matches = self._active(target)
        framing = _framing(head, bodyless=False, default=0)
        if matches:
            with self._lock:
                self._matched += 1
                number = self._matched
            if fault.slowdown_every and number % fault.slowdown_every == 0:
                self._slow_down(conn, reader, head, framing)
                return
            if fault.delay_seconds > 0:
                self._count("delayed")
                if self._stopped.wait(fault.delay_seconds):
                    raise _Broken("stopped")
        conn.pending.put((method, target))
        conn.upstream.sendall(head.raw)
        flip = None
        if matches and fault.flip_request_byte:
            flip = _Flip(self._claim_flip, length=None if framing == CHUNKED else framing,
                         aws_chunked="aws-chunked" in head.headers.get("content-encoding", ""))
        if framing == CHUNKED:
            _copy_chunked(reader, conn.upstream.sendall, flip=flip)
        else:
            _copy_length(reader, framing, conn.upstream.sendall, flip)

    def _slow_down(self, conn: _Conn, reader: _Reader, head: _Head, framing: int) -> None:
        """Answer with 503 SlowDown after reading (and dropping) the body, keeping the
        connection usable; a client that expects 100-continue is told to send its body first."""
        if head.headers.get("expect", "").lower() == "100-continue":
            conn.send_client(b"HTTP/1.1 100 Continue\r\n\r\n")
        if framing == CHUNKED:
            _copy_chunked(reader, lambda _: None)
        else:
            _copy_length(reader, framing, lambda _: None)
        method, target = head.start.split(" ")[:2]
        # Counted before the answer goes out: a client that got its 503 may read the stats at
        # once (seen under load: 3 counted for 4 answers).
        self._count("slowdowns")
        conn.send_client(_slowdown(target, head_only=method == "HEAD"))

    def _responses(self, conn: _Conn) -> None:
        """Upstream to client, one response at a time, each paired with its request."""
        reader = _Reader(conn.upstream)
        reset = False
        try:
            while not reset and (head := _read_head(reader)) is not None:
                reset = self._response(conn, reader, head)
        except (OSError, _Broken):
            pass
        finally:
            self._drop(conn, reset=reset)

    def _response(self, conn: _Conn, reader: _Reader, head: _Head) -> bool:
        """Forward one response; True when the connection must now be reset."""
        try:
            status = int(head.start.split(" ")[1])
        except (IndexError, ValueError) as err:
            raise _Broken("bad status line") from err
        if 100 <= status < 200:  # an interim response: the final one follows
            conn.send_client(head.raw)
            return False
        try:
            method, target = conn.pending.get_nowait()
        except queue.Empty:  # a response no request asked for (say, a 408 before closing)
            method, target = "GET", ""
        fault, matches = self._active(target)
        limit = fault.reset_response_over if matches else None
        framing = _framing(head, bodyless=method == "HEAD" or status in (204, 304),
                           default=UNTIL_CLOSE)
        conn.send_client(head.raw)
        if framing == CHUNKED:
            cut = _copy_chunked(reader, conn.send_client, limit=limit)
        elif framing == UNTIL_CLOSE:
            cut = _copy_until_close(reader, conn.send_client, limit)
        else:
            cut = limit is not None and framing > limit
            _copy_length(reader, framing if limit is None else min(framing, limit),
                         conn.send_client)
        if cut:
            _wait_delivered(conn.client)
        self._count("resets" if cut else "responses")
        return cut
