"""The on-disk spool: messages the broker could not take yet, in order, bounded, crash-safe.

A spool is a directory of segment files (``<id>.seg``, ids increasing) holding framed records
(topic, key, value and the number of samples the value carries). The `Publisher` writes to it
while the broker is unreachable and replays it, in order, when the broker is back; a new
`Spool` on the same directory (a restarted process) finds what was left and replays it.

Contract:

- **Order**: `read` returns records in the order they were appended (`prepend` puts records in
  front of everything not yet read, for messages older than what is spooled).
- **Bound**: the segment files never hold more than ``max_bytes``. When a record does not fit,
  the *oldest whole segment* is deleted and its unread records and samples are counted in
  `dropped` / `dropped_samples` (never silently). A record larger than ``max_bytes`` is refused
  (`SpoolError`).
- **Durability**: `sync` fsyncs what was appended (the caller groups appends, then syncs once).
  Consumed records are remembered in a small ``cursor`` file, so a restart replays only what was
  not committed (at worst a few committed records again: the sink drops repeats).
- **Crash safety**: every record is framed ``magic, length, crc32``; a torn or corrupt record
  (a crash mid-write, a bad disk) is detected, the rest of its segment is skipped with one
  warning and counted in `corrupt`; it never raises out of `read`. A new `Spool` never appends
  to a segment it did not create.
- **One owner**: an exclusive ``flock`` on ``<dir>/lock``; a second `Spool` on the same
  directory raises `SpoolLocked`. Not thread-safe: one thread (the publisher's) uses it.

This module is the public one: the queue itself (appending within the bound, reading, replay
after a failure, committing). The files' format (`SpoolRecord`, the record's framing and its
decoding, the segments' names, the cursor file) lives beside it in ``_spool_format``.

>>> import tempfile
>>> d = tempfile.mkdtemp()
>>> sp = Spool(d, max_bytes=1 << 20, segment_bytes=1 << 16)
>>> sp.append(SpoolRecord("perfloop.telemetry.step", b"job", b"payload-1", samples=3))
(0, 0)
>>> sp.append(SpoolRecord("perfloop.telemetry.step", b"job", b"payload-2"))
(0, 0)
>>> sp.sync(); sp.records
2
>>> [(r.value, r.samples) for r, _ in sp.read(10)]
[(b'payload-1', 3), (b'payload-2', 0)]
>>> sp.commit(sp.read_position()), sp.records
(2, 0)
>>> sp.close()
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path

from perfloop.exceptions import PerfloopError
from perfloop.producers._spool_format import (
    Position,
    Segment,
    SpoolRecord,
    count_records,
    decode,
    frame,
    fsync_dir,
    read_cursor,
    segment_ids,
    segment_path,
    write_cursor,
)

__all__ = ["Position", "Spool", "SpoolError", "SpoolLocked", "SpoolRecord"]

log = logging.getLogger("perfloop.producers.spool")

_FIRST_ID = 1 << 32  # leaves room below for `prepend`
_CURSOR_EVERY_S = 0.2


class SpoolError(PerfloopError):
    """A record cannot be spooled (larger than the spool, or the disk refused it)."""


class SpoolLocked(SpoolError):
    """Another spool (another process) owns this directory."""


class Spool:
    """A bounded, ordered, crash-safe queue of records on disk (see the module docstring)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_bytes: int,
        segment_bytes: int,
        fsync: bool = True,
    ) -> None:
        if max_bytes <= 0 or segment_bytes <= 0:
            raise ValueError(
                f"max_bytes and segment_bytes must be > 0, got {max_bytes} and {segment_bytes}"
            )
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self.segment_bytes = min(segment_bytes, max_bytes)
        self._fsync = fsync
        self.dropped = 0  # records deleted unread to make room (oldest first)
        self.dropped_samples = 0
        self.corrupt = 0  # records (or torn fragments) skipped as unreadable
        self.corrupt_bytes = 0
        self._warned = False
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self._lock_fd)
            raise SpoolLocked(f"spool {self.dir} is in use by another process") from e
        self._segs: deque[Segment] = deque()
        self._wfd: int | None = None  # the active (write) segment: always the last one
        self._rfd: tuple[int, int] | None = None  # (segment id, fd) open for reading
        self._dirty = False
        self._cursor_at = 0.0
        self._inflight: deque[tuple[int, int, int]] = deque()  # read, not committed
        self._load()

    # -- state -----------------------------------------------------------------------------
    @property
    def bytes(self) -> int:
        """Bytes on disk in segment files (the bound applies to this)."""
        return sum(s.size for s in self._segs)

    @property
    def records(self) -> int:
        """Records appended and not committed yet (read-but-uncommitted ones included)."""
        return sum(s.records - s.consumed for s in self._segs)

    @property
    def samples(self) -> int:
        """Samples in the records counted by `records`."""
        return sum(s.samples - s.consumed_samples for s in self._segs)

    def __len__(self) -> int:
        return self.records

    def read_position(self) -> Position:
        """Where `read` continues."""
        return self._read_pos

    # -- opening ---------------------------------------------------------------------------
    def _load(self) -> None:
        cur_id, cur_off = read_cursor(self.dir)
        for sid in sorted(segment_ids(self.dir)):
            path = self._path(sid)
            if sid < cur_id:  # fully consumed before a crash
                path.unlink(missing_ok=True)
                continue
            seg = Segment(sid, path, size=path.stat().st_size)
            self._scan(seg, consumed_before=cur_off if sid == cur_id else 0)
            if seg.records - seg.consumed == 0:
                path.unlink(missing_ok=True)
                continue
            self._segs.append(seg)
        self._commit_pos: Position = (0, 0)
        if self._segs:
            head = self._segs[0].id
            self._commit_pos = (head, cur_off) if head == cur_id else (head, 0)
        self._read_pos: Position = self._commit_pos
        self._next_id = self._segs[-1].id + 1 if self._segs else _FIRST_ID
        if self._segs:
            log.info(
                "spool %s: %d records (%d bytes) left from before, will replay",
                self.dir,
                self.records,
                self.bytes,
            )

    def _write_cursor(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._cursor_at < _CURSOR_EVERY_S:
            return
        self._cursor_at = now
        write_cursor(self.dir, self._commit_pos)

    def _scan(self, seg: Segment, consumed_before: int) -> None:
        """Count records by their headers (those ending by ``consumed_before`` as consumed);
        find a torn tail (a crash mid-write) and cut it off, so it is reported once."""
        torn = count_records(seg, consumed_before)
        if torn >= 0:
            self._torn(seg, torn, "torn or corrupt record", 1)
        if seg.end >= 0:
            with contextlib.suppress(OSError):
                os.truncate(seg.path, seg.end)
                seg.size = seg.end
                seg.end = -1

    def _torn(self, seg: Segment, off: int, why: str, records: int) -> None:
        lost = seg.size - off
        self.corrupt += max(records, 1)
        self.corrupt_bytes += lost
        seg.end = off
        if not self._warned:
            self._warned = True
            log.warning(
                "spool %s: %s in %s at byte %d; skipping the %d bytes after it",
                self.dir,
                why,
                seg.path.name,
                off,
                lost,
            )

    def _path(self, sid: int) -> Path:
        return segment_path(self.dir, sid)

    # -- writing ---------------------------------------------------------------------------
    def append(self, record: SpoolRecord) -> tuple[int, int]:
        """Append one record (durable after `sync`); return the (records, samples) dropped
        from the oldest segments to make room. Raise `SpoolError` if it cannot be written."""
        size = record.size
        if size > self.max_bytes:
            raise SpoolError(
                f"a {size}-byte message does not fit in the spool (spool_max_bytes "
                f"{self.max_bytes})"
            )
        dropped = self._make_room(size)
        if self._wfd is None or self._segs[-1].size + size > self.segment_bytes:
            self._rotate()
        seg = self._segs[-1]
        self._write(seg, record)
        return dropped

    def prepend(self, records: Iterable[SpoolRecord]) -> tuple[int, int]:
        """Put records (oldest first) in front of everything not read yet.

        Used for messages older than what is spooled (they failed after newer ones were
        spooled). If the spool cannot take them all, the oldest of them are dropped and
        counted; returns the (records, samples) dropped. If records were already read from
        the head segment, they are appended instead (order is then best effort).
        """
        recs = list(records)
        if not recs:
            return (0, 0)
        head = self._segs[0] if self._segs else None
        if head is None or self._inflight or head.consumed or self._read_pos[1]:
            dn = ds = 0
            for r in recs:
                try:
                    d = self.append(r)
                except SpoolError:
                    d = (1, r.samples)
                dn, ds = dn + d[0], ds + d[1]
            return (dn, ds)
        room = self.max_bytes - self.bytes
        keep: list[SpoolRecord] = []
        for r in reversed(recs):  # newest first: the oldest are the ones that do not fit
            if r.size > room:
                break
            keep.append(r)
            room -= r.size
        lost = recs[: len(recs) - len(keep)]
        dn, ds = len(lost), sum(r.samples for r in lost)
        self.dropped += dn
        self.dropped_samples += ds
        if not keep:
            return (dn, ds)
        seg = Segment(head.id - 1, self._path(head.id - 1))
        fd = os.open(seg.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for r in reversed(keep):
                self._write(seg, r, fd)
            if self._fsync:
                os.fsync(fd)
        except BaseException:
            seg.path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        if self._fsync:
            fsync_dir(self.dir)
        self._segs.appendleft(seg)
        self._commit_pos = self._read_pos = (seg.id, 0)
        self._write_cursor(force=True)
        return (dn, ds)

    def sync(self) -> None:
        """Make every appended record durable (fsync of the active segment)."""
        if self._dirty and self._wfd is not None and self._fsync:
            os.fsync(self._wfd)
        self._dirty = False

    def _write(self, seg: Segment, record: SpoolRecord, fd: int | None = None) -> None:
        parts, total = frame(record)
        target = self._wfd if fd is None else fd
        assert target is not None
        try:
            written = os.writev(target, parts)
            while written < total:  # a short write: finish it from where it stopped
                rest = b"".join(parts)[written:]
                written += os.write(target, rest)
        except OSError as e:
            with contextlib.suppress(OSError):  # never leave a torn record behind
                os.ftruncate(target, seg.size)
                os.lseek(target, seg.size, os.SEEK_SET)
            raise SpoolError(f"cannot write to spool {self.dir}: {e}") from e
        seg.size += total
        seg.records += 1
        seg.samples += record.samples
        self._dirty = True

    def _rotate(self) -> None:
        if self._wfd is not None:
            self.sync()
            os.close(self._wfd)
            self._wfd = None
        seg = Segment(self._next_id, self._path(self._next_id))
        self._next_id += 1
        self._wfd = os.open(seg.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if self._fsync:
            fsync_dir(self.dir)
        self._segs.append(seg)
        if len(self._segs) == 1:
            self._commit_pos = self._read_pos = (seg.id, 0)

    def _make_room(self, size: int) -> tuple[int, int]:
        dn = ds = 0
        while self._segs and self.bytes + size > self.max_bytes:
            if len(self._segs) == 1 and self._wfd is not None:
                self._rotate()  # never delete the segment being written: start a new one
            n, s = self._drop_head()
            dn, ds = dn + n, ds + s
        if dn:
            log.warning(
                "spool %s is full (%d bytes): dropped the oldest %d messages (%d samples)",
                self.dir,
                self.max_bytes,
                dn,
                ds,
            )
        return (dn, ds)

    def _drop_head(self) -> tuple[int, int]:
        seg = self._segs.popleft()
        read_n = sum(1 for sid, _, _ in self._inflight if sid == seg.id)
        read_s = sum(s for sid, _, s in self._inflight if sid == seg.id)
        n = seg.records - seg.consumed - read_n
        s = seg.samples - seg.consumed_samples - read_s
        self._close_reader(seg.id)
        seg.path.unlink(missing_ok=True)
        self.dropped += max(n, 0)
        self.dropped_samples += max(s, 0)
        nxt = (self._segs[0].id, 0) if self._segs else (self._next_id, 0)
        if self._commit_pos[0] <= seg.id:
            self._commit_pos = nxt
        if self._read_pos[0] <= seg.id:
            self._read_pos = nxt
        self._write_cursor(force=True)
        return (max(n, 0), max(s, 0))

    # -- reading ---------------------------------------------------------------------------
    def read(
        self, max_records: int, max_bytes: int = 1 << 62
    ) -> list[tuple[SpoolRecord, Position]]:
        """Up to ``max_records`` records (at least one if any, within ``max_bytes`` after the
        first) from the read position, each with the position just after it; advances the
        read position. Corrupt records are skipped (counted in `corrupt`)."""
        out: list[tuple[SpoolRecord, Position]] = []
        taken = 0
        while len(out) < max_records and (not out or taken < max_bytes):
            got = self._read_one()
            if got is None:
                break
            rec, pos = got
            out.append((rec, pos))
            taken += rec.size
        return out

    def _seg(self, sid: int) -> Segment | None:
        for s in self._segs:
            if s.id == sid:
                return s
        return None

    def _reader(self, seg: Segment) -> int:
        if self._rfd is not None and self._rfd[0] == seg.id:
            return self._rfd[1]
        self._close_reader()
        fd = os.open(seg.path, os.O_RDONLY)
        self._rfd = (seg.id, fd)
        return fd

    def _close_reader(self, sid: int | None = None) -> None:
        if self._rfd is not None and (sid is None or self._rfd[0] == sid):
            os.close(self._rfd[1])
            self._rfd = None

    def _next_seg(self, sid: int) -> Position | None:
        for s in self._segs:
            if s.id > sid:
                return (s.id, 0)
        return None

    def _read_one(self) -> tuple[SpoolRecord, Position] | None:
        while True:
            sid, off = self._read_pos
            seg = self._seg(sid)
            if seg is None:
                nxt = self._next_seg(sid)
                if nxt is None:
                    return None
                self._read_pos = nxt
                continue
            limit = seg.end if seg.end >= 0 else seg.size
            if off >= limit:
                nxt = self._next_seg(sid)
                if nxt is None:
                    return None
                self._read_pos = nxt
                continue
            rec, size, why = decode(self._reader(seg), off, limit)
            if rec is None:  # corrupt: skip the rest of this segment (counted)
                lost = max(seg.records - seg.consumed - self._counted_upto(seg, off), 0)
                seg.records -= lost
                self._torn(seg, off, why, lost)
                if self._wfd is not None and seg is self._segs[-1]:
                    self._rotate()  # appends after the damage would be unreachable
                continue
            end = (sid, off + size)
            self._read_pos = end
            self._inflight.append((sid, off + size, rec.samples))
            return rec, end

    def _counted_upto(self, seg: Segment, off: int) -> int:
        """Records of a segment before ``off`` that were read and not yet committed."""
        return sum(1 for sid, end, _ in self._inflight if sid == seg.id and end <= off)

    def rewind(self) -> tuple[int, int]:
        """Move the read position back to the commit position (after a failed replay).

        Returns the (records, samples) that were read from segments since dropped to make
        room: they are gone and the caller counts them.
        """
        live = {s.id for s in self._segs}
        gone = [(sid, s) for sid, _, s in self._inflight if sid not in live]
        self._inflight.clear()
        self._read_pos = self._commit_pos
        if self._segs and self._read_pos[0] < self._segs[0].id:
            self._read_pos = self._commit_pos = (self._segs[0].id, 0)
        return (len(gone), sum(s for _, s in gone))

    def commit(self, pos: Position) -> int:
        """Everything read up to ``pos`` was delivered: forget it (delete consumed segments);
        return the number of records committed. Positions of dropped segments are ignored."""
        n = 0
        while self._inflight and self._inflight[0][:2] <= pos:
            sid, end, samples = self._inflight.popleft()
            seg = self._seg(sid)
            if seg is None:
                continue
            seg.consumed += 1
            seg.consumed_samples += samples
            self._commit_pos = (sid, end)
            n += 1
        # Delete whole segments that are consumed (the active one only once rotated away).
        while self._segs:
            head = self._segs[0]
            active = self._wfd is not None and head is self._segs[-1]
            if head.consumed < head.records or head.id > self._commit_pos[0]:
                break
            limit = head.end if head.end >= 0 else head.size
            if self._commit_pos[0] == head.id and self._commit_pos[1] < limit:
                break
            if active:
                if self.records == 0:  # empty: start over in a fresh segment next time
                    os.close(self._wfd)  # type: ignore[arg-type]
                    self._wfd = None
                else:
                    break
            self._segs.popleft()
            self._close_reader(head.id)
            head.path.unlink(missing_ok=True)
            nxt = self._next_seg(head.id) or (self._next_id, 0)
            if self._commit_pos[0] == head.id:
                self._commit_pos = nxt
            if self._read_pos[0] == head.id:
                self._read_pos = nxt
        if n:
            self._write_cursor(force=not self._segs)
        return n

    def close(self) -> None:
        """Sync, save the cursor and release the directory."""
        if self._lock_fd < 0:
            return
        self.sync()
        self._write_cursor(force=True)
        if self._wfd is not None:
            os.close(self._wfd)
            self._wfd = None
        self._close_reader()
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)
        self._lock_fd = -1

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
