"""The on-disk spool: order, the byte bound (oldest segment dropped and counted), persistence
across a restart, and recovery from torn or corrupt records (skipped, counted, never raised)."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from perfloop.producers.spool import Spool, SpoolError, SpoolLocked, SpoolRecord

TOPIC = "perfloop.telemetry.step"


def rec(i: int, size: int = 100, samples: int = 1) -> SpoolRecord:
    return SpoolRecord(TOPIC, b"job", f"{i:08d}".encode() + b"x" * (size - 8), samples)


def values(sp: Spool, n: int = 10_000) -> list[bytes]:
    return [r.value[:8] for r, _ in sp.read(n)]


def ids(*nums: int) -> list[bytes]:
    return [f"{i:08d}".encode() for i in nums]


def segments(d: Path) -> list[Path]:
    return sorted(d.glob("*.seg"))


def test_records_come_back_in_order_across_segments(tmp_path: Path) -> None:
    with Spool(tmp_path, max_bytes=1 << 20, segment_bytes=1000) as sp:
        for i in range(30):
            assert sp.append(rec(i)) == (0, 0)
        sp.sync()
        assert len(segments(tmp_path)) > 3
        assert sp.records == 30 and sp.samples == 30
        assert values(sp) == ids(*range(30))
        assert sp.read(5) == []  # nothing more to read


def test_commit_forgets_records_and_deletes_consumed_segments(tmp_path: Path) -> None:
    with Spool(tmp_path, max_bytes=1 << 20, segment_bytes=1000) as sp:
        for i in range(30):
            sp.append(rec(i))
        got = sp.read(20)
        assert sp.commit(got[-1][1]) == 20
        assert sp.records == 10
        assert len(segments(tmp_path)) < 4  # whole consumed segments are gone
        assert values(sp) == ids(*range(20, 30))
        assert sp.commit(sp.read_position()) == 10
        assert sp.records == 0 and sp.bytes == 0 and segments(tmp_path) == []


def test_rewind_reads_uncommitted_records_again(tmp_path: Path) -> None:
    with Spool(tmp_path, max_bytes=1 << 20, segment_bytes=1000) as sp:
        for i in range(6):
            sp.append(rec(i))
        got = sp.read(4)
        sp.commit(got[0][1])
        assert sp.rewind() == (0, 0)
        assert values(sp) == ids(1, 2, 3, 4, 5)


def test_full_spool_drops_the_oldest_whole_segment_and_counts_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    size = rec(0).size
    with Spool(tmp_path, max_bytes=10 * size, segment_bytes=3 * size) as sp:
        dropped = [0, 0]
        for i in range(25):
            n, s = sp.append(rec(i, samples=7))
            dropped[0] += n
            dropped[1] += s
            assert sp.bytes <= 10 * size  # the bound holds after every append
        assert dropped == [sp.dropped, sp.dropped_samples]
        assert sp.dropped == 25 - sp.records and sp.dropped_samples == 7 * sp.dropped
        kept = values(sp)
        assert kept == ids(*range(25 - len(kept), 25))  # the newest, still in order
        assert sp.dropped % 3 == 0  # whole segments only
    assert "dropped the oldest" in caplog.text


def test_a_record_larger_than_the_spool_is_refused(tmp_path: Path) -> None:
    with Spool(tmp_path, max_bytes=1000, segment_bytes=500) as sp:
        sp.append(rec(0))
        with pytest.raises(SpoolError, match="does not fit"):
            sp.append(rec(1, size=2000))
        assert values(sp) == ids(0)


def test_dropping_a_segment_being_replayed_counts_what_was_read_only_if_it_is_lost(
    tmp_path: Path,
) -> None:
    size = rec(0).size
    with Spool(tmp_path, max_bytes=6 * size, segment_bytes=3 * size) as sp:
        for i in range(6):
            sp.append(rec(i))
        sp.read(2)  # in flight to the broker
        sp.append(rec(6))  # no room: the head segment goes
        assert sp.dropped == 1  # only the unread record of that segment
        assert sp.rewind() == (2, 2)  # the two in flight can no longer be read again
        assert values(sp) == ids(3, 4, 5, 6)


def test_records_survive_a_restart_and_committed_ones_do_not_come_back(tmp_path: Path) -> None:
    sp = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=1000)
    for i in range(20):
        sp.append(rec(i, samples=2))
    sp.sync()
    got = sp.read(12)
    sp.commit(got[-1][1])
    sp.close()
    with Spool(tmp_path, max_bytes=1 << 20, segment_bytes=1000) as again:
        assert again.records == 8 and again.samples == 16
        again.append(rec(20))  # a restarted spool appends after what it found
        assert values(again) == ids(*range(12, 21))


def test_prepend_puts_older_records_first_and_persists(tmp_path: Path) -> None:
    with Spool(tmp_path, max_bytes=1 << 20, segment_bytes=1000) as sp:
        sp.append(rec(10))
        sp.append(rec(11))
        assert sp.prepend([rec(1), rec(2)]) == (0, 0)
    with Spool(tmp_path, max_bytes=1 << 20, segment_bytes=1000) as sp:
        assert values(sp) == ids(1, 2, 10, 11)


def test_prepend_drops_the_oldest_of_its_records_when_full(tmp_path: Path) -> None:
    size = rec(0).size
    with Spool(tmp_path, max_bytes=4 * size, segment_bytes=4 * size) as sp:
        sp.append(rec(10))
        sp.append(rec(11))
        assert sp.prepend([rec(1), rec(2), rec(3)]) == (1, 1)
        assert values(sp) == ids(2, 3, 10, 11)


def test_a_second_spool_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    with Spool(tmp_path, max_bytes=1000, segment_bytes=500), pytest.raises(SpoolLocked):
        Spool(tmp_path, max_bytes=1000, segment_bytes=500)


def test_torn_tail_after_a_crash_is_skipped_once_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sp = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=1 << 20)
    for i in range(5):
        sp.append(rec(i))
    sp.close()
    seg = segments(tmp_path)[-1]
    os.truncate(seg, seg.stat().st_size - 30)  # the last record was being written
    with caplog.at_level(logging.WARNING, logger="perfloop.producers.spool"):
        sp = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=1 << 20)
    assert sp.corrupt == 1 and sp.records == 4
    assert len([r for r in caplog.records if "torn" in r.getMessage()]) == 1
    sp.append(rec(5))
    assert values(sp) == ids(0, 1, 2, 3, 5)
    sp.close()
    with Spool(tmp_path, max_bytes=1 << 20, segment_bytes=1 << 20) as again:
        assert again.corrupt == 0  # reported once: the fragment was cut off


def test_a_corrupt_record_skips_the_rest_of_its_segment_and_reading_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    size = rec(0).size
    with Spool(tmp_path, max_bytes=1 << 20, segment_bytes=4 * size) as sp:
        for i in range(8):
            sp.append(rec(i))
        sp.sync()
        first = segments(tmp_path)[0]
        with open(first, "r+b") as f:  # flip a byte in the value of the second record
            f.seek(size + size - 5)
            b = f.read(1)
            f.seek(size + size - 5)
            f.write(bytes([b[0] ^ 0xFF]))
        assert values(sp) == ids(0, 4, 5, 6, 7)
        assert sp.corrupt == 3  # the bad record and the two after it in that segment
        got = sp.read(1)
        assert got == []
        assert "checksum mismatch" in caplog.text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(min_value=8, max_value=300), min_size=1, max_size=12),
    cut=st.floats(min_value=0.0, max_value=1.0),
    flip=st.one_of(st.none(), st.floats(min_value=0.0, max_value=0.999)),
)
def test_damaged_segment_yields_a_prefix_of_what_was_written_and_never_raises(
    sizes: list[int], cut: float, flip: float | None
) -> None:
    with tempfile.TemporaryDirectory() as d:
        written = [rec(i, size) for i, size in enumerate(sizes)]
        with Spool(d, max_bytes=1 << 20, segment_bytes=1 << 20) as sp:
            for r in written:
                sp.append(r)
        seg = segments(Path(d))[0]
        data = bytearray(seg.read_bytes())
        data = data[: int(len(data) * cut)]
        if flip is not None and data:
            data[int(len(data) * flip)] ^= 0x55
        seg.write_bytes(bytes(data))
        with Spool(d, max_bytes=1 << 20, segment_bytes=1 << 20) as sp:
            got = [r for r, _ in sp.read(100)]
            assert got == written[: len(got)]
            assert sp.corrupt <= len(written)
            assert sp.records == len(got)  # what is left to replay is what was readable
