"""The sans-IO consensus core: messages, term history, quorum math, state machines."""
