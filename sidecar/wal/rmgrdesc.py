"""Resource manager and record type names exactly as PostgreSQL 15's pg_waldump prints them (rmgrdesc *_identify())."""

from __future__ import annotations

from sidecar.wal.format import RM_MAX_BUILTIN_ID, RM_MIN_CUSTOM_ID, rmid_is_valid

RM_XACT_ID = 1
RM_HEAP_ID = 10
XLOG_XACT_OPMASK = 0x70

_ = None  # rm_identify() returns NULL: pg_waldump prints "UNKNOWN (%x)"

# Index i of a row is the name for xl_info high nibble i (info = i << 4), as rm_identify(i << 4) returns it.
_BUILTIN: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    ("XLOG", ("CHECKPOINT_SHUTDOWN", "CHECKPOINT_ONLINE", "NOOP", "NEXTOID", "SWITCH", "BACKUP_END",
              "PARAMETER_CHANGE", "RESTORE_POINT", "FPW_CHANGE", "END_OF_RECOVERY", "FPI_FOR_HINT", "FPI",
              _, "OVERWRITE_CONTRECORD", _, _)),
    # Bit 0x80 is XLOG_XACT_HAS_INFO; xact_identify() masks it with XLOG_XACT_OPMASK.
    ("Transaction", ("COMMIT", "PREPARE", "ABORT", "COMMIT_PREPARED", "ABORT_PREPARED", "ASSIGNMENT",
                     "INVALIDATION", _) * 2),
    ("Storage", (_, "CREATE", "TRUNCATE") + (_,) * 13),
    ("CLOG", ("ZEROPAGE", "TRUNCATE") + (_,) * 14),
    ("Database", ("CREATE_FILE_COPY", "CREATE_WAL_LOG", "DROP") + (_,) * 13),
    ("Tablespace", ("CREATE", "DROP") + (_,) * 14),
    ("MultiXact", ("ZERO_OFF_PAGE", "ZERO_MEM_PAGE", "CREATE_ID", "TRUNCATE_ID") + (_,) * 12),
    ("RelMap", ("UPDATE",) + (_,) * 15),
    ("Standby", ("LOCK", "RUNNING_XACTS", "INVALIDATIONS") + (_,) * 13),
    ("Heap2", ("REWRITE", "PRUNE", "VACUUM", "FREEZE_PAGE", "VISIBLE", "MULTI_INSERT", "LOCK_UPDATED", "NEW_CID",
               _, _, _, _, _, "MULTI_INSERT+INIT", _, _)),
    ("Heap", ("INSERT", "DELETE", "UPDATE", "TRUNCATE", "HOT_UPDATE", "HEAP_CONFIRM", "LOCK", "INPLACE",
              "INSERT+INIT", _, "UPDATE+INIT", _, "HOT_UPDATE+INIT", _, _, _)),
    ("Btree", ("INSERT_LEAF", "INSERT_UPPER", "INSERT_META", "SPLIT_L", "SPLIT_R", "INSERT_POST", "DEDUP",
               "DELETE", "UNLINK_PAGE", "UNLINK_PAGE_META", "NEWROOT", "MARK_PAGE_HALFDEAD", "VACUUM",
               "REUSE_PAGE", "META_CLEANUP", _)),
    ("Hash", ("INIT_META_PAGE", "INIT_BITMAP_PAGE", "INSERT", "ADD_OVFL_PAGE", "SPLIT_ALLOCATE_PAGE",
              "SPLIT_PAGE", "SPLIT_COMPLETE", "MOVE_PAGE_CONTENTS", "SQUEEZE_PAGE", "DELETE", "SPLIT_CLEANUP",
              "UPDATE_META_PAGE", "VACUUM_ONE_PAGE", _, _, _)),
    ("Gin", (_, "CREATE_PTREE", "INSERT", "SPLIT", "VACUUM_PAGE", "DELETE_PAGE", "UPDATE_META_PAGE",
             "INSERT_LISTPAGE", "DELETE_LISTPAGE", "VACUUM_DATA_LEAF_PAGE") + (_,) * 6),
    ("Gist", ("PAGE_UPDATE", "DELETE", "PAGE_REUSE", "PAGE_SPLIT", _, _, "PAGE_DELETE", "ASSIGN_LSN") + (_,) * 8),
    ("Sequence", ("LOG",) + (_,) * 15),
    ("SPGist", (_, "ADD_LEAF", "MOVE_LEAFS", "ADD_NODE", "SPLIT_TUPLE", "PICKSPLIT", "VACUUM_LEAF",
                "VACUUM_ROOT", "VACUUM_REDIRECT") + (_,) * 7),
    ("BRIN", ("CREATE_INDEX", "INSERT", "UPDATE", "SAMEPAGE_UPDATE", "REVMAP_EXTEND", "DESUMMARIZE", _, _, _,
              "INSERT+INIT", "UPDATE+INIT", _, _, _, _, _)),
    ("CommitTs", ("ZEROPAGE", "TRUNCATE") + (_,) * 14),
    ("ReplicationOrigin", ("SET", "DROP") + (_,) * 14),
    ("Generic", ("Generic",) * 16),
    ("LogicalMessage", ("MESSAGE",) + (_,) * 15),
)

assert len(_BUILTIN) == RM_MAX_BUILTIN_ID + 1 and all(len(names) == 16 for _n, names in _BUILTIN)

RMGR_NAMES: tuple[str, ...] = tuple(name for name, _names in _BUILTIN)


def rmgr_name(rmid: int) -> str:
    """The resource manager's name; custom ones (128-255) are `custom###` as in pg_waldump."""
    if 0 <= rmid <= RM_MAX_BUILTIN_ID:
        return RMGR_NAMES[rmid]
    if rmid_is_valid(rmid):
        return f"custom{rmid:03d}"
    raise ValueError(f"invalid resource manager ID {rmid}")


def identify(rmid: int, info: int) -> str:
    """Record type name for xl_info as rm_identify() gives it, or `UNKNOWN (%x)` for an unnamed combination."""
    recid = (info & 0xF0) >> 4
    if 0 <= rmid <= RM_MAX_BUILTIN_ID:
        name = _BUILTIN[rmid][1][recid]
        if name is not None:
            return name
    elif not rmid_is_valid(rmid):
        raise ValueError(f"invalid resource manager ID {rmid}")
    return f"UNKNOWN ({recid << 4:x})"


def stats_recid(rmid: int, info: int) -> int:
    """The per-record-type key of pg_waldump --stats=record: info >> 4, with the xact HAS_INFO bit masked."""
    recid = info >> 4
    return recid & 0x07 if rmid == RM_XACT_ID else recid


def stats_row_name(rmid: int, recid: int) -> str:
    """The row label pg_waldump --stats=record prints for (rmid, recid)."""
    return f"{rmgr_name(rmid)}/{identify(rmid, recid << 4)}"


def is_custom(rmid: int) -> bool:
    """A custom resource manager id (128-255)."""
    return rmid >= RM_MIN_CUSTOM_ID
