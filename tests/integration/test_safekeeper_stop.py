"""A safekeeper stopped by a signal while its proposer streams: every thread ends cleanly, exit 0,
and what it acknowledged last is on its disk (a real safekeeper process, a real primary, TLS)."""

from __future__ import annotations

import re
import signal

import pytest

from support.deployment import Deployment, Writer
from support.helpers import created, wait_for
from sidecar.lsn import parse_lsn
from sidecar.safekeeper.server import Safekeeper

pytestmark = pytest.mark.integration

_STOPPED = re.compile(r"\] stopped\s.*?flush_lsn=([0-9A-F]+/[0-9A-F]+)")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_streaming_safekeeper_stops_cleanly_on_a_signal(deployment: Deployment, sig: signal.Signals) -> None:
    d = deployment
    sk = d.safekeepers[1]
    writer = Writer(d.pg.dsn())
    writer.start()
    try:
        wait_for(lambda: "elected" in sk.log_text() and len(writer.acked) >= 200 or writer.error is not None,
                 timeout=60, what="commits streamed through safekeeper 1")
        assert writer.error is None, writer.error
        status = sk.stop(timeout=30, sig=sig)
    finally:
        acked = writer.stop()
    log = sk.log_text()
    assert status == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert "connection threads still running" not in log, log[-3000:]
    stopped = _STOPPED.findall(log)
    assert stopped, log[-3000:]
    last_acknowledged = parse_lsn(stopped[-1])
    reopened = Safekeeper.open(1, created(d.sk_dir(1), 1), "127.0.0.1", 0)
    try:
        assert reopened.acceptor.write_lsn >= last_acknowledged > 0
    finally:
        reopened.storage.close()
    assert len(acked) >= 200  # the other two safekeepers kept acknowledging
