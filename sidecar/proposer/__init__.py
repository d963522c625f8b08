"""The proposer as a process, attached to a PostgreSQL primary.

"Proposer" is the protocol role. `sidecar.consensus.proposer` is the state machine that plays it
in the core, sans IO; this package runs it as a process (the primary's connections, the safekeeper
links, what it shows operators), as `sidecar.safekeeper` runs `consensus.acceptor`.
"""
