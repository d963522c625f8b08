"""Safekeeper links: PeerLink against fake safekeepers on 127.0.0.1 (nothing a peer sends ends
the link), and how the service carries out the core's verdicts on a link or on the term space."""

from __future__ import annotations

import asyncio
import errno
import socket
import struct

import structlog
from tenacity import AsyncRetrying, RetryCallState

from support.helpers import run, until
from sidecar import framing
from sidecar.consensus import codec
from sidecar.consensus.limits import MAX_TERM
from sidecar.consensus.messages import Greeting, GreetingReply, Message, VoteRequest
from sidecar.consensus.proposer import DropPeer, Send, TermsExhausted
from sidecar.proposer.options import StartOptions
from sidecar.proposer.peers import CONNECT_PAUSE_MAX, CONNECTION_REFUSED_PAUSE_MAX, PeerLink, connect_pause
from sidecar.proposer.service import ProposerService, ProposerStopped

GREETING = Greeting(1, "p", 42, 1, 16 << 20, 150000)


class FakeSafekeeper:
    """Answers a Greeting with `answers[n]` on its n-th connection (raw bytes), then as a safekeeper."""

    def __init__(self, answers: list[bytes]) -> None:
        self.answers = answers
        self.connections = 0
        self.received: list[Message] = []
        self.server: asyncio.Server | None = None

    async def handle(self, reader: framing.FrameReader, writer: framing.Writer) -> None:
        n = self.connections
        self.connections += 1
        try:
            while True:
                msg = await reader.read_message()
                self.received.append(msg)
                if isinstance(msg, Greeting):
                    writer.write(self.answers[n] if n < len(self.answers) else codec.encode(GreetingReply(7, 3)))
        except (codec.ProtocolError, asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def start(self) -> str:
        self.server = await framing.start_server(self.handle, "127.0.0.1", 0)
        return "127.0.0.1:%d" % self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


class Callbacks:
    """What the service would do: greet on connect, record messages; `fail` raises from the callback."""

    def __init__(self, fail: int = 0) -> None:
        self.link: PeerLink | None = None
        self.messages: list[Message] = []
        self.ups = self.downs = 0
        self.fail = fail

    def up(self, name: str) -> None:
        self.ups += 1
        assert self.link is not None
        self.link.send(GREETING)

    def message(self, name: str, msg: Message) -> None:
        if self.fail:
            self.fail -= 1
            raise RuntimeError("a bug in handling the reply")
        self.messages.append(msg)

    def down(self, name: str) -> None:
        self.downs += 1


async def _linked(fake: FakeSafekeeper, callbacks: Callbacks) -> tuple[PeerLink, asyncio.Task[None]]:
    name = await fake.start()
    link = PeerLink(name, callbacks.up, callbacks.message, callbacks.down)
    callbacks.link = link
    return link, asyncio.ensure_future(link.run())


def test_a_malformed_or_lying_reply_drops_the_link_which_reconnects_and_works() -> None:
    garbage = struct.pack(">IB", 3, ord("z")) + b"??"
    huge_term = struct.pack(">IBQQH", 19, ord("G"), 1, MAX_TERM + 1, 0)  # no safekeeper may hold it

    async def main() -> None:
        fake = FakeSafekeeper([garbage, huge_term])
        cb = Callbacks()
        with structlog.testing.capture_logs() as logs:
            link, task = await _linked(fake, cb)
            await until(lambda: cb.messages, "a reply on the third connection")
            assert cb.messages == [GreetingReply(7, 3)] and fake.connections == 3
            assert link.connected and not task.done()
            link.send(VoteRequest(4))  # and it works
            await until(lambda: VoteRequest(4) in fake.received, "the vote request")
            task.cancel()
        errors = [e for e in logs if e["log_level"] == "error"]
        assert [e["event"] for e in errors] == ["malformed message from safekeeper; reconnecting"] * 2
        assert "unknown message tag" in errors[0]["reason"] and "outside" in errors[1]["reason"]
        assert cb.ups == 3 and cb.downs == 2
        await fake.close()

    run(main())


def test_an_exception_in_the_message_callback_does_not_end_the_link() -> None:
    async def main() -> None:
        fake = FakeSafekeeper([])
        cb = Callbacks(fail=1)
        with structlog.testing.capture_logs() as logs:
            link, task = await _linked(fake, cb)
            await until(lambda: cb.messages, "a reply handled after the failure")
            assert fake.connections == 2 and not task.done()
            task.cancel()
        [error] = [e for e in logs if e["log_level"] == "error"]
        assert error["event"] == "handling a message from safekeeper failed; reconnecting"
        assert error["stage"] == "GreetingReply" and "a bug in handling the reply" in error["error"]
        await fake.close()

    run(main())


def test_a_link_dropped_for_a_protocol_error_reconnects() -> None:
    async def main() -> None:
        fake = FakeSafekeeper([])
        cb = Callbacks()
        link, task = await _linked(fake, cb)
        await until(lambda: cb.messages, "the first reply")
        link.drop(faulted=True)
        await until(lambda: len(cb.messages) == 2, "a reply on the next connection")
        assert fake.connections == 2 and cb.downs == 1
        task.cancel()
        await fake.close()

    run(main())


def test_connection_failures_are_logged_with_the_reason_at_a_slowing_rate() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main() -> None:
        link = PeerLink(f"127.0.0.1:{port}", lambda n: None, lambda n, m: None, lambda n: None)
        with structlog.testing.capture_logs() as logs:
            task = asyncio.ensure_future(link.run())
            await until(lambda: len([e for e in logs if e["log_level"] == "warning"]) >= 3, "three warnings")
            task.cancel()
        warnings = [e for e in logs if e["log_level"] == "warning"]
        assert {e["event"] for e in warnings} == {"cannot connect to safekeeper; retrying"}
        assert all(e["reason"] == "Connection refused" for e in warnings)
        assert [e["attempts"] for e in warnings][:3] == [1, 2, 4]

    run(main())


def _service() -> ProposerService:
    return ProposerService(StartOptions("dbname=none", ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"), 2))


def test_terms_exhausted_stops_the_proposer_with_a_message() -> None:
    async def main() -> None:
        svc = _service()
        with structlog.testing.capture_logs() as logs:
            svc._run([TermsExhausted(MAX_TERM, "127.0.0.1:2")])
        assert isinstance(svc._refusal, ProposerStopped) and svc._term_over.is_set()
        assert f"safekeeper 127.0.0.1:2 holds term {MAX_TERM}" in str(svc._refusal)
        assert [e["event"] for e in logs if e["log_level"] == "critical"] == ["no term left to campaign in"]

    run(main())


def test_a_message_we_cannot_encode_stops_the_proposer_instead_of_looping() -> None:
    async def main() -> None:
        svc = _service()

        class Connected:
            def write(self, *parts: bytes) -> bool:
                return True

        svc.links["127.0.0.1:1"]._writer = Connected()  # type: ignore[assignment]
        svc._run([Send("127.0.0.1:1", VoteRequest(MAX_TERM + 1))])  # a send from a link callback
        assert isinstance(svc._refusal, ProposerStopped) and "cannot encode" in str(svc._refusal)

        svc = _service()

        async def fails() -> None:  # the same from a background task (the primary check, a fetch)
            codec.encode(VoteRequest(MAX_TERM + 1))

        task = svc._spawn(fails())
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)
        assert isinstance(svc._refusal, ProposerStopped)

    run(main())


def test_drop_peer_is_logged_with_the_term_and_positions() -> None:
    async def main() -> None:
        svc = _service()
        with structlog.testing.capture_logs() as logs:
            svc._run([DropPeer("127.0.0.1:3", "AppendReply acknowledges WAL it was never sent",
                               {"term": 4, "flush_lsn": 0x9000000, "sent_lsn": 0x1000100})])
        [e] = logs
        assert (e["event"], e["log_level"], e["peer"], e["term"]) == (
            "safekeeper broke the protocol; dropping the link", "error", "127.0.0.1:3", 4)
        assert (e["flush_lsn"], e["sent_lsn"]) == ("0/9000000", "0/1000100")
        assert svc._refusal is None

    run(main())


def _pause_after(error: BaseException, attempts: int) -> float:
    state = RetryCallState(AsyncRetrying(), None, (), {})
    state.attempt_number = attempts
    state.set_exception((type(error), error, None))
    return connect_pause(state)


def test_a_refused_connection_is_retried_soon_however_long_the_safekeeper_was_down() -> None:
    refused = ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
    assert _pause_after(refused, 1) == 0.05  # the usual growth first
    assert _pause_after(refused, 30) == CONNECTION_REFUSED_PAUSE_MAX < CONNECT_PAUSE_MAX
    # A timeout or an unreachable network: the pause grows to CONNECT_PAUSE_MAX.
    assert _pause_after(asyncio.TimeoutError(), 30) == CONNECT_PAUSE_MAX
    assert _pause_after(OSError(errno.ENETUNREACH, "Network is unreachable"), 30) == CONNECT_PAUSE_MAX
