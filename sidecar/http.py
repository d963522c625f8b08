"""A minimal HTTP endpoint on the service's own event loop: /metrics, /status and health routes.

Handlers are synchronous and read in-memory state only, so a scrape never waits on the
primary or a safekeeper. One request per connection (Prometheus and curl are happy with that).
Everything served is read-only. On a loopback address it is plain HTTP; anywhere else it is
HTTPS with the node's certificate (`--certs-dir`), or plain HTTP only under `--insecure`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from sidecar.address import cannot_listen, parse_listen
from sidecar.logs import get_logger

MAX_REQUEST_HEAD = 8192
REQUEST_TIMEOUT = 10.0


@dataclass(frozen=True)
class Response:
    status: int
    content_type: str
    body: bytes


Handler = Callable[[], Response]

_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 400: "Bad Request",
            500: "Internal Server Error", 503: "Service Unavailable"}


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses: only this machine can connect."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def endpoint_tls(host: str, certs_dir: Path | None) -> ssl.SSLContext | None:
    """HTTPS for an endpoint off loopback when there are certificates; else plain HTTP."""
    if certs_dir is None or is_loopback(host):
        return None
    from sidecar.tls import https_context
    return https_context(certs_dir)


def endpoint_url(address: str, ssl_context: ssl.SSLContext | None) -> str:
    """The URL a tool reaches an endpoint at: https off loopback when it has certificates."""
    host, _ = parse_listen(address)
    return ("https" if ssl_context is not None and not is_loopback(host) else "http") + f"://{address}"


def json_response(doc: Any, status: int = 200) -> Response:
    return Response(status, "application/json", (json.dumps(doc, indent=2, sort_keys=False) + "\n").encode())


def metrics_handler(registry: CollectorRegistry) -> Handler:
    return lambda: Response(200, CONTENT_TYPE_LATEST, generate_latest(registry))


class HttpEndpoint:
    """Serves GET/HEAD on a fixed set of paths until closed."""

    def __init__(self, host: str, port: int, routes: dict[str, Handler], what: str = "metrics") -> None:
        self.host, self.port = host, port
        self.routes = routes
        self.what = what
        self.ssl_context: ssl.SSLContext | None = None  # HTTPS when set (see endpoint_tls)
        self._server: asyncio.Server | None = None
        self.log = get_logger(endpoint=f"{host}:{port}")

    async def start(self) -> None:
        """Bind now, so a taken port is reported before the service starts working."""
        try:
            self._server = await asyncio.start_server(self._handle, self.host, self.port, ssl=self.ssl_context,
                                                      ssl_handshake_timeout=REQUEST_TIMEOUT if self.ssl_context else None)
        except OSError as e:
            raise cannot_listen(self.host, self.port, f"the {self.what} endpoint (--metrics)", e) from e
        sock = self._server.sockets[0]
        self.port = sock.getsockname()[1]
        scheme = "https" if self.ssl_context is not None else "http"
        self.log.info("serving metrics and status", url=f"{scheme}://{self.host}:{self.port}/metrics",
                      paths=sorted(self.routes))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
            method, path = _request_line(head)
            if method not in ("GET", "HEAD"):
                resp = Response(405, "text/plain", b"only GET and HEAD\n")
            else:
                handler = self.routes.get(path.split("?", 1)[0].rstrip("/") or "/")
                if handler is None:
                    listing = "".join(f"{p}\n" for p in sorted(self.routes))
                    resp = Response(404, "text/plain", f"not found; try:\n{listing}".encode())
                else:
                    try:
                        resp = handler()
                    except Exception as e:  # a broken handler must not take the service down
                        self.log.exception("endpoint handler failed", path=path)
                        resp = Response(500, "text/plain", f"{type(e).__name__}: {e}\n".encode())
            writer.write(_response_bytes(resp, head_only=method == "HEAD"))
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ValueError):
            with contextlib.suppress(Exception):
                writer.write(_response_bytes(Response(400, "text/plain", b"bad request\n")))
        except OSError:  # the client went away, or broke TLS
            pass
        finally:
            writer.close()


def _request_line(head: bytes) -> tuple[str, str]:
    if len(head) > MAX_REQUEST_HEAD:
        raise ValueError("request head too large")
    parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise ValueError("not an HTTP request line")
    return parts[0], parts[1]


def _response_bytes(resp: Response, head_only: bool = False) -> bytes:
    head = (f"HTTP/1.1 {resp.status} {_REASONS.get(resp.status, '')}\r\n"
            f"Content-Type: {resp.content_type}\r\nContent-Length: {len(resp.body)}\r\n"
            "Connection: close\r\n\r\n").encode()
    return head if head_only else head + resp.body


async def run_with_endpoint(main: Any, endpoint: HttpEndpoint | None) -> None:
    """Run the service coroutine `main` with `endpoint` serving alongside it."""
    if endpoint is None:
        await main
        return
    try:
        await endpoint.start()
    except BaseException:
        main.close()
        raise
    try:
        await main
    finally:
        await endpoint.close()
