"""``status --serve``: the swarm's page, ``/api/status`` and ``/metrics``, served from the reads ``status`` makes.

The reading loop (:func:`p2p_diloco.cli.status.cmd_status`) hands each read's ``status --json`` object to
:meth:`StatusServer.update`; the server only answers with the latest one:

- ``/``: one page (:data:`~p2p_diloco.net.dashboard_page.PAGE`, everything inline: no asset is fetched from
  anywhere) that fetches the two JSON paths below every refresh and draws the tables and charts;
- ``/api/status``: the latest read, exactly what ``status --json`` prints;
- ``/api/history``: the chart points of the reads so far (:class:`~p2p_diloco.net.dashboard.History`) and the
  consensus in ``status``'s words;
- ``/metrics``: the latest read in Prometheus's text format (:func:`~p2p_diloco.net.dashboard.status_families`,
  written by prometheus_client).

Read-only (GET and HEAD only) and nothing secret: the swarm key is never part of a read.
The standard library's threading HTTP server: a page for a few browsers and a scraper needs no framework.
"""

from __future__ import annotations

import errno
import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

from p2p_diloco.net.dashboard import History, ServeAddress, status_families
from p2p_diloco.net.dashboard_page import PAGE
from p2p_diloco.net.report import CONSENSUS, consensus_text

logger = logging.getLogger(__name__)

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _StatusCollector:
    """prometheus_client's collector protocol over the server's latest read."""

    def __init__(self, server: "StatusServer") -> None:
        self.server = server

    def collect(self) -> Iterator[Any]:
        data = self.server.latest()
        if data is not None:
            yield from status_families(data)


class StatusServer:
    """The HTTP server of ``status --serve``, answering from a thread of its own.

    Bound at construction, so that a taken port fails before the DHT starts (``ValueError``, one line)."""

    def __init__(self, address: ServeAddress, flag: str = "--serve", refresh_s: float = 2.0) -> None:
        from prometheus_client import CollectorRegistry

        self.address = address
        self.refresh_s = refresh_s
        self.history = History()
        self._latest: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_StatusCollector(self))  # prometheus_client duck-types collectors (collect())
        server_class = type("_Server", (ThreadingHTTPServer,), {"address_family": _family(address.host),
                                                                 "daemon_threads": True})
        try:
            self._httpd = server_class((address.host, address.port), _handler(self))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"{flag} {address.host}:{address.port}: port {address.port} is already in use; "
                                 f"pick another port") from None
            raise ValueError(f"{flag} {address.host}:{address.port}: cannot listen there ({e.strerror or e})") from None
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="status-server", daemon=True)

    @property
    def port(self) -> int:
        """The port it listens on (the one the OS chose, for port 0)."""
        return int(self._httpd.server_address[1])

    def start(self) -> "StatusServer":
        self._thread.start()
        return self

    def update(self, data: dict[str, Any]) -> None:
        """A new read (``status --json``'s object): served from now on, and a point of the charts."""
        with self._lock:
            self._latest = data
            self.history.add(data)

    def latest(self) -> dict[str, Any] | None:
        with self._lock:
            return self._latest

    def history_json(self) -> dict[str, Any]:
        """The charts' points, the refresh period, and the latest read's consensus in words (as ``status`` prints
        it) with its definition."""
        with self._lock:
            latest = self._latest
            return {**self.history.to_json(), "refresh_s": self.refresh_s, "definition": CONSENSUS,
                    "consensus": consensus_text(latest["summary"]) if latest is not None else "-"}

    def metrics_text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self._registry)

    def close(self) -> None:
        """Stop answering and release the port."""
        if self._thread.is_alive():
            self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> "StatusServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _family(host: str) -> int:
    import socket

    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _handler(server: StatusServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "p2p-diloco"

        def do_GET(self) -> None:
            self._answer(send_body=True)

        def do_HEAD(self) -> None:
            self._answer(send_body=False)

        def _answer(self, send_body: bool) -> None:
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                body, kind = PAGE.encode(), "text/html; charset=utf-8"
            elif path == "/api/status":
                data = server.latest()
                if data is None:
                    self._send(HTTPStatus.SERVICE_UNAVAILABLE, b'{"error": "no read of the DHT yet"}\n',
                               "application/json", send_body)
                    return
                body, kind = json.dumps(data).encode(), "application/json"
            elif path == "/api/history":
                body, kind = json.dumps(server.history_json()).encode(), "application/json"
            elif path == "/metrics":
                body, kind = server.metrics_text(), PROMETHEUS_CONTENT_TYPE
            else:
                self._send(HTTPStatus.NOT_FOUND, b"not found: /, /api/status, /api/history, /metrics\n",
                           "text/plain; charset=utf-8", send_body)
                return
            self._send(HTTPStatus.OK, body, kind, send_body)

        def _send(self, status: HTTPStatus, body: bytes, kind: str, send_body: bool) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            # the page needs nothing from elsewhere: say so to the browser too
            self.send_header("Content-Security-Policy", "default-src 'self'; script-src 'unsafe-inline'; "
                             "style-src 'unsafe-inline'; img-src 'self' data:")
            self.end_headers()
            if send_body:
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # one DEBUG line per request, not stderr noise
            logger.debug("%s %s", self.address_string(), format % args)

    return Handler
