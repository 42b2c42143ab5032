"""The spool's files on disk, for `perfloop.producers.spool.Spool`: what a record, a segment
and the cursor look like as bytes, and how each is written, counted and read back.

- A *segment* is a file ``<id>.seg`` (the id zero-padded to 20 digits, so names sort as ids)
  of records one after the other. `Segment` is what the spool keeps in memory about one.
- A *record* (`SpoolRecord`) is framed as a header ``magic, length, crc32`` then its body:
  ``samples, topic length, key length``, the topic, the key and the value. `frame` makes
  those bytes, `decode` reads one back (or says why it cannot: a torn or corrupt record is
  never raised), `count_records` walks a segment's headers when a spool opens.
- The *cursor* (file ``cursor``) is the position committed so far, with a crc32 of its 16
  bytes: a torn cursor reads as none (replay from the start, the sink drops repeats).
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Position",
    "Segment",
    "SpoolRecord",
    "count_records",
    "decode",
    "frame",
    "fsync_dir",
    "read_cursor",
    "segment_ids",
    "segment_path",
    "write_cursor",
]

# The spool's own logger: what the spool says is found under one name wherever it is said.
log = logging.getLogger("perfloop.producers.spool")

Position = tuple[int, int]
"""(segment id, byte offset): where a record starts, or where the next one would."""

_MAGIC = b"PFS1"
_HEADER = struct.Struct("<4sII")  # magic, payload length, crc32(payload)
_META = struct.Struct("<IHI")  # samples, topic length, key length; then topic, key, value
_CURSOR = struct.Struct("<QQI")  # segment id, offset, crc32 of the 16 bytes before
_SUFFIX = ".seg"


@dataclass(frozen=True, slots=True)
class SpoolRecord:
    """One spooled message: where it goes, its key and value, and its sample count."""

    topic: str
    key: bytes
    value: bytes
    samples: int = 0

    @property
    def size(self) -> int:
        """Bytes this record takes in a segment file."""
        return (
            _HEADER.size + _META.size + len(self.topic.encode()) + len(self.key) + len(self.value)
        )


@dataclass
class Segment:
    """What the spool knows of one segment file, kept up to date as it appends and commits."""

    id: int
    path: Path
    size: int = 0  # bytes in the file
    records: int = 0  # every record in the file
    samples: int = 0
    consumed: int = 0  # records committed (at the head segment only)
    consumed_samples: int = 0
    end: int = -1  # where a torn or corrupt tail starts (-1: none found)


def fsync_dir(path: Path) -> None:
    """Make a file's creation or removal in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def segment_path(directory: Path, sid: int) -> Path:
    return directory / f"{sid:020d}{_SUFFIX}"


def segment_ids(directory: Path) -> list[int]:
    """The ids of the segment files in ``directory`` (other files are not the spool's)."""
    ids = []
    for p in directory.glob(f"*{_SUFFIX}"):
        try:
            ids.append(int(p.name[: -len(_SUFFIX)]))
        except ValueError:
            continue
    return ids


def read_cursor(directory: Path) -> Position:
    """The position committed so far; ``(0, 0)`` when there is none or it is damaged."""
    try:
        raw = (directory / "cursor").read_bytes()
        sid, off, crc = _CURSOR.unpack(raw)
    except (OSError, struct.error):
        return (0, 0)
    if zlib.crc32(raw[:16]) != crc:
        return (0, 0)
    return (sid, off)


def write_cursor(directory: Path, pos: Position) -> None:
    """Save ``pos`` as the committed position (replacing the file whole); never raises."""
    sid, off = pos
    head = struct.pack("<QQ", sid, off)
    tmp = directory / "cursor.tmp"
    try:
        tmp.write_bytes(head + struct.pack("<I", zlib.crc32(head)))
        os.replace(tmp, directory / "cursor")
    except OSError as e:  # a lost cursor only means replaying some records twice
        log.warning("spool %s: cannot save the read cursor: %s", directory, e)


def frame(record: SpoolRecord) -> tuple[list[bytes], int]:
    """The record's bytes in a segment, as the parts to write, and their total length."""
    topic = record.topic.encode()
    meta = _META.pack(record.samples, len(topic), len(record.key))
    crc = zlib.crc32(record.value, zlib.crc32(record.key, zlib.crc32(topic, zlib.crc32(meta))))
    length = len(meta) + len(topic) + len(record.key) + len(record.value)
    parts = [_HEADER.pack(_MAGIC, length, crc), meta, topic, record.key, record.value]
    return parts, _HEADER.size + length


def count_records(seg: Segment, consumed_before: int) -> int:
    """Count a segment's records by their headers into ``seg`` (those ending by
    ``consumed_before`` as consumed); return where a torn tail starts (a crash mid-write),
    or -1."""
    fd = os.open(seg.path, os.O_RDONLY)
    try:
        off = 0
        while off < seg.size:
            head = os.pread(fd, _HEADER.size + _META.size, off)
            bad = len(head) < _HEADER.size + _META.size
            if not bad:
                magic, length, _ = _HEADER.unpack_from(head)
                bad = magic != _MAGIC or length < _META.size
                bad = bad or off + _HEADER.size + length > seg.size
            if bad:
                return off
            samples = _META.unpack_from(head, _HEADER.size)[0]
            off += _HEADER.size + length
            seg.records += 1
            seg.samples += samples
            if off <= consumed_before:
                seg.consumed += 1
                seg.consumed_samples += samples
    finally:
        os.close(fd)
    return -1


def decode(fd: int, off: int, limit: int) -> tuple[SpoolRecord | None, int, str]:
    """The record at ``off`` of the segment open as ``fd`` (none past ``limit``) and the bytes
    it takes; or None, 0 and why it cannot be read."""
    head = os.pread(fd, _HEADER.size, off)
    why = ""
    if len(head) < _HEADER.size:
        why = "truncated record header"
    else:
        magic, length, crc = _HEADER.unpack(head)
        if magic != _MAGIC or length < _META.size or off + _HEADER.size + length > limit:
            why = "bad record header"
        else:
            body = os.pread(fd, length, off + _HEADER.size)
            if len(body) < length:
                why = "truncated record"
            elif zlib.crc32(body) != crc:
                why = "checksum mismatch"
            else:
                samples, tlen, klen = _META.unpack_from(body)
                a = _META.size
                if a + tlen + klen > length:
                    why = "bad record lengths"
                else:
                    try:
                        topic = body[a : a + tlen].decode()
                    except UnicodeDecodeError:
                        why = "bad topic name"
                    else:
                        key = body[a + tlen : a + tlen + klen]
                        value = body[a + tlen + klen :]
                        rec = SpoolRecord(topic, key, value, samples)
                        return rec, _HEADER.size + length, ""
    return None, 0, why
