"""A stand-in for a trainer's `GET /progress` and `POST /control`: a real HTTP server on
loopback, for the operator's tests of its progress poll (unit and integration tiers alike)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class StandInProgress:
    """A stand-in for a trainer's `GET /progress` on 127.0.0.1 (or `host`): serves `document`
    and counts the polls (`paths`: what each asked for, query included, a POST as "POST
    <path>"); with `answers`, only that many polls get it and later ones 503 (a trainer that
    gave up at start serves its reason until one poll read it, then exits). `POST /control`
    as the trainer answers it: 403 without `token` (no control token), 401 for another
    bearer, else the desired world is kept in `told` (and the pods said to be moving in
    `told_moving`) and the document served."""

    def __init__(self, document: dict[str, Any] | None = None,
                 answers: int | None = None, *, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None) -> None:
        self.document: dict[str, Any] = document or {}
        self.polls = 0
        self.paths: list[str] = []
        self.told: list[int] = []
        self.told_moving: list[list[str]] = []
        self.token = token  # may be set later (a job's token is known once it exists)
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                stand_in.polls += 1
                stand_in.paths.append(self.path)
                if answers is not None and stand_in.polls > answers:
                    self.send_error(503)
                    return
                # As the trainer does: the query is not part of the path (and changes nothing).
                self._send(200 if self.path.partition("?")[0] == "/progress" else 404)

            def do_POST(self) -> None:
                stand_in.paths.append(f"POST {self.path}")
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path != "/control":
                    self.send_error(404)
                elif stand_in.token is None:
                    self.send_error(403)
                elif self.headers.get("Authorization") != f"Bearer {stand_in.token}":
                    self.send_error(401)
                else:
                    message = json.loads(body)
                    stand_in.told.append(int(message["replicas"]))
                    stand_in.told_moving.append(list(message.get("moving", [])))
                    self._send(200)

            def _send(self, code: int) -> None:
                body = json.dumps(stand_in.document).encode()
                self.send_response(code)
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
