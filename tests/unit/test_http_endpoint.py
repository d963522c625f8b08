"""The metrics/status endpoint over a real socket, and the InfoRequest answer of a real safekeeper."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from support.helpers import created, run
from sidecar.http import HttpEndpoint, Response, json_response
from sidecar.metrics import SafekeeperMetrics
from sidecar.ops.probe import fetch_status
from sidecar.skclient import ProbeError, probe_safekeeper
from sidecar.safekeeper.control import load_control
from sidecar.safekeeper.monitor import SafekeeperMonitor
from sidecar.safekeeper.server import Safekeeper


async def http(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data


def test_routes_methods_and_errors() -> None:
    async def main() -> None:
        ep = HttpEndpoint("127.0.0.1", 0, {"/status": lambda: json_response({"a": 1}),
                                           "/boom": lambda: 1 / 0,  # type: ignore[dict-item]
                                           "/x": lambda: Response(503, "text/plain", b"no\n")})
        await ep.start()
        try:
            got = await http(ep.port, b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n")
            head, body = got.split(b"\r\n\r\n", 1)
            assert head.startswith(b"HTTP/1.1 200") and json.loads(body) == {"a": 1}
            assert (await http(ep.port, b"HEAD /status HTTP/1.0\r\n\r\n")).endswith(b"\r\n\r\n")
            assert (await http(ep.port, b"GET /nope HTTP/1.0\r\n\r\n")).startswith(b"HTTP/1.1 404")
            assert (await http(ep.port, b"POST /status HTTP/1.0\r\n\r\n")).startswith(b"HTTP/1.1 405")
            assert (await http(ep.port, b"garbage\r\n\r\n")).startswith(b"HTTP/1.1 400")
            assert (await http(ep.port, b"GET /boom HTTP/1.0\r\n\r\n")).startswith(b"HTTP/1.1 500")
            assert (await http(ep.port, b"GET /x HTTP/1.0\r\n\r\n")).startswith(b"HTTP/1.1 503")
            assert await fetch_status(f"127.0.0.1:{ep.port}", 5) == {"a": 1}
        finally:
            await ep.close()

    run(main())


def test_taken_port_is_reported() -> None:
    async def main() -> None:
        a = HttpEndpoint("127.0.0.1", 0, {})
        await a.start()
        try:
            b = HttpEndpoint("127.0.0.1", a.port, {})
            try:
                await b.start()
            except OSError as e:
                assert f"cannot listen on 127.0.0.1:{a.port}" in str(e)
            else:
                raise AssertionError("a second endpoint bound the same port")
        finally:
            await a.close()

    run(main())


def test_safekeeper_answers_info_without_binding_itself(tmp_path: Path) -> None:
    async def main() -> None:
        sk = Safekeeper.open(4, created(tmp_path, 4), "127.0.0.1", 0)
        mon = SafekeeperMonitor(sk)
        server = asyncio.ensure_future(sk.serve())
        try:
            from support.helpers import until
            await until(lambda: sk.listening_port is not None, "the safekeeper to listen")
            port = sk.listening_port
            info = await probe_safekeeper(f"127.0.0.1:{port}", 5)
            assert (info.node_id, info.system_id, info.term, info.proposer_connected) == (4, 0, 0, False)
            ep = mon.endpoint("127.0.0.1", 0)
            await ep.start()
            try:
                doc = await fetch_status(f"127.0.0.1:{ep.port}", 5)
                assert doc["id"] == 4 and doc["system_id"] is None and doc["proposer_connected"] is False
                assert "data_dir" not in doc and doc["insecure"] is True
                text = (await http(ep.port, b"GET /metrics HTTP/1.0\r\n\r\n")).split(b"\r\n\r\n", 1)[1]
                names = {f.name for f in text_string_to_metric_families(text.decode())}
                assert {"walsidecar_safekeeper_term", "walsidecar_safekeeper_fsync_seconds",
                        "walsidecar_safekeeper_wal_written_bytes"} <= names
            finally:
                await ep.close()
        finally:
            server.cancel()
            try:
                await server
            except asyncio.CancelledError:
                pass
        control = load_control(tmp_path)
        assert control is None or control.state.system_id == 0, "an InfoRequest must not bind the safekeeper"

    run(main())


def test_probe_of_nothing_says_why() -> None:
    from support.helpers import free_port

    async def main() -> None:
        try:
            await probe_safekeeper(f"127.0.0.1:{free_port()}", 2)
        except ProbeError as e:
            assert "refused" in str(e).lower()
        else:
            raise AssertionError("probing a closed port succeeded")

    run(main())


def test_metric_names_are_prefixed() -> None:
    m = SafekeeperMetrics(1)
    from prometheus_client import generate_latest
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        assert fam.name.startswith("walsidecar_"), fam.name
