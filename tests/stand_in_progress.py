"""A stand-in for a trainer's `GET /progress`: a real HTTP server on loopback, for the operator's
tests of its progress poll (unit and integration tiers alike)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class StandInProgress:
    """A stand-in for a trainer's `GET /progress` on 127.0.0.1 (or `host`): serves `document`
    and counts the polls (`paths`: what each asked for, query included); with `answers`, only
    that many polls get it and later ones 503 (a trainer that gave up at start serves its
    reason until one poll read it, then exits)."""

    def __init__(self, document: dict[str, Any] | None = None,
                 answers: int | None = None, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.document: dict[str, Any] = document or {}
        self.polls = 0
        self.paths: list[str] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                stand_in.polls += 1
                stand_in.paths.append(self.path)
                if answers is not None and stand_in.polls > answers:
                    self.send_error(503)
                    return
                body = json.dumps(stand_in.document).encode()
                # As the trainer does: the query (?replicas=N) is not part of the path.
                self.send_response(200 if self.path.partition("?")[0] == "/progress" else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
