"""Creating a safekeeper's data directory as a member of a new cluster (`walsidecar safekeeper-init`).

Run once per safekeeper when a cluster is made, never on a restart: it writes the control file at term 0,
with the number of members. From then on a data directory without a control file is a lost disk, which
learns its term from its peers before it votes (amnesia.py), so that no empty disk votes twice in a term.
"""

from __future__ import annotations

from pathlib import Path

from sidecar.consensus import limits
from sidecar.consensus.state import AcceptorState
from sidecar.safekeeper.control import ControlData, control_path, load_control, save_control

# Made by a filesystem, not by a safekeeper: a mount point's data directory may hold it.
_IGNORED = {"lost+found"}


class CreateError(Exception):
    """The data directory is not one a new cluster's safekeeper may be created in."""


def create_data_dir(node_id: int, data_dir: Path, members: int) -> None:
    """Make `data_dir` safekeeper `node_id`'s, in a new cluster of `members` safekeepers: term 0, nothing stored.

    Refuses a directory that holds anything: a safekeeper's (even a partly wiped one) must learn its term
    from its peers instead, and something else's is not ours to take.
    """
    if node_id < 1:
        raise CreateError(f"safekeeper id {node_id}: ids are 1 or more")
    if not 1 <= members <= limits.MAX_MEMBERS:
        raise CreateError(f"--members {members}: a cluster has 1 to {limits.MAX_MEMBERS} safekeepers")
    data_dir = Path(data_dir)
    if control_path(data_dir).exists():
        owner = load_control(data_dir)
        raise CreateError(f"{data_dir} already holds safekeeper {owner.node_id if owner else '?'}'s control file: "
                          "it is created once, when its cluster is made; start it with `walsidecar safekeeper`")
    if data_dir.exists():
        if not data_dir.is_dir():
            raise CreateError(f"{data_dir} is not a directory")
        found = sorted(p.name for p in data_dir.iterdir() if p.name not in _IGNORED)
        if found:
            raise CreateError(f"{data_dir} is not empty ({', '.join(found[:5])}): a safekeeper whose control file "
                              "is gone lost its disk and must learn its term from its peers (start it with --peers); "
                              "create a new cluster's safekeeper only in an empty directory")
    data_dir.mkdir(parents=True, exist_ok=True)
    save_control(data_dir, ControlData(node_id, AcceptorState(members=members)))
