from sidecar.safekeeper.horizon import removal_horizon

SEG = 16 << 20


def test_archive_bounds_removal_and_the_result_is_a_segment_boundary():
    h = removal_horizon(flush_lsn=10 * SEG, commit_lsn=9 * SEG + 5, backup_lsn=4 * SEG + 100, seg_size=SEG)
    assert (h.lsn, h.held_by) == (4 * SEG, "backup_lsn (the archive)")


def test_nothing_above_commit_or_flush_goes_even_if_archived():
    assert removal_horizon(flush_lsn=10 * SEG, commit_lsn=3 * SEG + 1, backup_lsn=8 * SEG, seg_size=SEG).lsn == 3 * SEG
    h = removal_horizon(flush_lsn=2 * SEG + 7, commit_lsn=9 * SEG, backup_lsn=8 * SEG, seg_size=SEG)
    assert (h.lsn, h.held_by) == (2 * SEG, "flush_lsn")


def test_a_reader_slot_pins_wal():
    h = removal_horizon(flush_lsn=10 * SEG, commit_lsn=10 * SEG, backup_lsn=10 * SEG, seg_size=SEG,
                        slot_lsns=[7 * SEG + 3, 2 * SEG + 9])
    assert (h.lsn, h.held_by) == (2 * SEG, "a reader slot")


def test_without_archive_the_retention_bounds_it_and_without_either_nothing_goes():
    h = removal_horizon(flush_lsn=10 * SEG, commit_lsn=10 * SEG, seg_size=SEG, keep_bytes=3 * SEG)
    assert (h.lsn, h.held_by) == (7 * SEG, "the retention (--keep-wal)")
    assert removal_horizon(flush_lsn=2 * SEG, commit_lsn=2 * SEG, seg_size=SEG, keep_bytes=3 * SEG).lsn == 0
    h = removal_horizon(flush_lsn=10 * SEG, commit_lsn=10 * SEG, seg_size=SEG)
    assert (h.lsn, h.held_by) == (0, "no archive and no retention set")


def test_the_segment_of_the_last_flushed_byte_stays():
    h = removal_horizon(flush_lsn=10 * SEG, commit_lsn=10 * SEG, backup_lsn=10 * SEG, seg_size=SEG)
    assert (h.lsn, h.held_by) == (9 * SEG, "flush_lsn")
