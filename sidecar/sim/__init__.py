"""Deterministic simulation of the consensus core against a hostile, simulated world.

The real `Proposer`, `Acceptor` and `AcceptorSession` state machines run unchanged; everything around them
is simulated, pure and seeded (no sockets, files or clocks), so a seed replays exactly:
`python3 scripts/simulate.py --seeds 1 --first-seed S --trace`.

The model, and why it is what it is (one module per actor; `world` puts them together and
schedules them, `checker` reads their state, `nodes`, after every step):

* Network (`network`). A connection is TCP: FIFO in each direction, never reordering, duplicating or
  losing a message by itself. Its two ends close independently. The proposer end's
  close discards unread replies; what it already sent may still arrive (or a random
  suffix of it may be lost when the cause is a network failure); the safekeeper reads
  that stale traffic and answers into the void until it sees EOF. The safekeeper end's
  close (crash, refused message) discards unread requests; the proposer reads the
  replies already sent, then EOF. Reordering and duplication happen the way TCP lets
  them: across connections. A proposer reconnects and resends Elected and Appends while
  the old connection still delivers its own copies, so a safekeeper sees old and new
  traffic interleaved. At the end of a term a link may linger: the next term's core is
  told it is connected and reads replies meant for its predecessor before the EOF (the
  service's race between `link.drop()` and the next `_one_term`). Connections can be
  slow (a per-connection delay), partitions stop chosen proposer/safekeeper pairs in
  both directions until they heal.
* Safekeepers (`safekeepers`, their disks `wal.Disk`). Each connection is served in the steps its
  thread takes on a real safekeeper (`safekeeper/proposerport.py`): a message and its writes
  under the acceptor lock; for the term's connection, the real `consensus.GroupCommit` asked
  whether to read on or sync; the fdatasync; then, under the lock, `on_flushed` and the reply.
  Other connections' messages, a vote or an Elected above all, are scheduled between any two of
  those steps. WAL is written at arbitrary offsets and is durable only once fsynced (one fsync
  covers everything written). A crash keeps the
  fsynced bytes plus any prefix of the unsynced ones (all of them for a process kill,
  none to some for a power loss), sometimes followed by torn junk. The control file is
  atomic. A restart finds the end of the last complete record (`wal.record_end`) and cuts
  there; a vote and an Elected first fsync and find it the same way, and a vote fingerprints that last
  record for the primary check, wherever it lies, as walcheck's `record_end` does. A crash can strike
  between any two actions of one message (after a Truncate, before its Persist). A disk can be
  lost: the control file and WAL wiped, the process restarted later with the same id on an empty
  directory, so amnesic (it asks the peers that are up for their terms, as `safekeeper/amnesia.py`
  does, before it greets or votes; `SimConfig.amnesia_rule=False` shows the double vote without it),
  then grants no vote until its WAL holds the start of a later term (`SimConfig.later_term_rule=False`
  shows the acknowledged commit lost without it). Any safekeeper's disk, whatever it alone held of the
  acknowledged WAL, but one at a time: none while another is amnesic or not yet holding a later term.
  The cluster is created explicitly: every safekeeper starts with a control file naming the members.
* WAL is records (`wal.encode_record`: length, back-pointer, CRC), so "the end of the
  last complete record" is found by walking headers, as PostgreSQL does.
* Primaries (`primaries`, their pg_wal `wal.Primary`). Each writes records and flushes to
  any position, often in the middle of a record (a WAL page written out before the record is complete).
  Walsenders send only flushed WAL, as the real walsender does: that alone produces the
  overwrite case, because a partially flushed record is sent, and a crash that loses
  its unflushed tail makes recovery stop at the previous record and write new WAL over
  the bytes already sent. Nothing is relaxed. A primary can crash and recover, be
  replaced by a standby promoted at a record end it had replayed (a new timeline, with
  the old primary stopped or, sometimes, still running), be replaced by a copy restored
  from an older point, or come back stale after being replaced.
* Proposer services (`services`). Each is one `walsidecar start` process attached
  to one primary: a new `Proposer` per replication stream (min_term = the last term it
  saw), the primary check of `_check_primary` (flush, timeline switches below E, CRC of
  the donor's tail record), catch-up from the primary's WAL, heartbeats, election
  timeouts. A service can crash (a fresh process knows no term) and be restarted, and a
  second one can run against the same or another primary at the same time: the
  advisory lock that prevents this in production is not modeled, because the protocol
  must be safe without it.

* Hostile peers (`hostile`). A connection that belongs to no proposer, greets, and claims the current
  term without its vote (an Append after the WAL, or an Elected); one that asks for a vote in
  the current term and sends an Elected cutting below the commit position; a read-only
  connection trying to vote; and, where the proposer checks reported positions, a safekeeper
  reply claiming a flush it cannot hold. Each safekeeper connection runs through the same
  `AcceptorSession` as the server's, so these meet the real rules.

* Degraded acknowledgements (`broker`, `services`, `failovers`). In a share of seeds (`SimConfig.degrade`, drawn
  apart from the rest) the services run `--commit-wait degrade-after`, the time being the step number: the real
  core opens, versions and closes ranges against a durable etcd model that answers later than asked and compares
  as the real transactions do, and each failover gates on the range it reads there. In those seeds a primary
  changes only through a failover and no rival sidecar runs (the gate and the advisory lock are what the
  design relies on); `SimConfig.degraded_gate=False` shows the acknowledgement a promotion loses without the gate.

* Readers (`readers`): standbys and `pg_receivewal` reading from any safekeeper that is up, through
  the real `ReadCursor`, resuming at their last complete record after an error, a crash of the
  safekeeper or the end of their timeline (a promoted primary's switch point, which they then follow).

`checker` states precisely which invariants of docs/protocol.md are checked after every step.
"""

from sidecar.sim.checker import Violation
from sidecar.sim.profile import SimConfig
from sidecar.sim.runner import Outcome, run_seed, run_seeds
from sidecar.sim.world import World

__all__ = ["Outcome", "SimConfig", "Violation", "World", "run_seed", "run_seeds"]
