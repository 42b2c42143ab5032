"""The series registry of the windows: jobs, sources, metric names and series ids.

A source is one kind of telemetry of one node of a job (job, node, kind): the kinds of a node
come from different producers (the node sampler, the training processes) with their own
publishing delays, so each has its own event-time watermark. It remembers the input (channel)
its batches came by, whose state says whether its silence is real (`WindowSet.set_channel`),
and a source whose time another component sets (`WindowSet.set_clock`) keeps that clock.

A series is (job, node, rank, device, metric) and gets a small int id (``sid``), reused after
its source is forgotten, so per-series arrays stay dense and bounded. Ids are looked up in
bulk for samples of many sources at once: each source owns a segment of one global table
indexed by (rank - its lowest rank, device - its lowest device), which gives a slot per
(source, rank, device); a (slot × metric id) table gives the sid. A million samples cost a
dozen vectorised passes; only unseen ranks, devices and series take the slow path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Job", "Registry", "Source"]

_I64 = np.int64
_ALWAYS = np.iinfo(np.int64).min  # a series' windows count from any start
Raw = tuple[str, int, int, dict[str, np.ndarray]]  # kind, tmin, tmax, columns


class Job:
    """One job: its index, sources, when new specs / metric families started (since) and the
    wall time its first batch was read (``born``; -1 unknown)."""

    __slots__ = ("born", "family_since", "idx", "name", "sources", "spec_since")

    def __init__(self, idx: int, name: str) -> None:
        self.idx, self.name = idx, name
        self.born = -1
        self.sources: list[Source] = []
        self.spec_since: dict[tuple[int, int], int] = {}
        self.family_since: dict[str, int] = {}


class Source:
    """One (job, node, kind): event-time watermark, wall time last seen, when its last message
    was sent (the producer's clock, -1: unknown), the usual time between its messages (``gap``,
    ns), batches not read, the channel it came by (None: unknown) and its set clock (-1: none,
    its time is its own)."""

    __slots__ = (
        "channel",
        "clock",
        "gap",
        "idx",
        "job",
        "kind",
        "measured",
        "node",
        "raw",
        "seen",
        "sent",
        "wm",
    )

    def __init__(self, idx: int, job: int, node: str, kind: str) -> None:
        self.idx, self.job, self.node, self.kind = idx, job, node, kind
        self.wm = -1
        self.seen = 0
        self.sent = -1
        self.gap = 0
        self.measured = False  # whether ``gap`` comes from gaps seen, not a first guess
        self.raw: list[Raw] = []  # batches waiting for a pane of theirs to close
        self.channel: Any = None
        self.clock = -1

    def state(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__slots__}
        d["raw"] = [(k, a, b, dict(c)) for k, a, b, c in self.raw]
        return d

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> Source:
        s = cls(d["idx"], d["job"], d["node"], d["kind"])
        s.wm, s.seen, s.raw = d["wm"], d["seen"], list(d["raw"])
        s.channel, s.clock, s.sent = d.get("channel"), d.get("clock", -1), d.get("sent", -1)
        s.gap, s.measured = d.get("gap", 0), d.get("measured", False)
        return s


def _grow(a: np.ndarray, n: int, fill: Any) -> np.ndarray:
    if n <= len(a):
        return a
    out = np.full(max(n, 2 * len(a), 64), fill, dtype=a.dtype)
    out[: len(a)] = a
    return out


class Registry:
    """Jobs, sources, metric names and series ids (see the module docstring)."""

    # Per series id, per source index, per job index (grown by doubling; set via setattr).
    sid_src: np.ndarray
    sid_job: np.ndarray
    sid_rank: np.ndarray
    sid_dev: np.ndarray
    sid_mid: np.ndarray
    sid_since: np.ndarray
    src_job: np.ndarray
    src_base: np.ndarray
    src_rlo: np.ndarray
    src_rn: np.ndarray
    src_dlo: np.ndarray
    src_dn: np.ndarray
    job_cu: np.ndarray  # closed until (ns): the job's panes that end by then have closed
    glut: np.ndarray  # the sources' segments: (rank, device) -> slot
    slot_src: np.ndarray

    _SID_COLS = ("sid_src", "sid_job", "sid_rank", "sid_dev", "sid_mid", "sid_since")
    _SRC_COLS = ("src_job", "src_base", "src_rlo", "src_rn", "src_dlo", "src_dn")
    _ARRAYS = (*_SID_COLS, *_SRC_COLS, "job_cu", "glut", "slot_src")

    def __init__(self) -> None:
        self.metric_names: list[str] = []
        self.metric_family: list[str] = []
        self._mid: dict[str, int] = {}
        self.metric_arr = np.zeros(0, dtype=object)
        self.jobs: dict[str, Job] = {}
        self.sources: dict[tuple[str, str, str], Source] = {}  # (job, node, kind)
        self.job_name = np.zeros(0, dtype=object)
        self.src_node = np.zeros(0, dtype=object)
        for c in self._ARRAYS:
            setattr(self, c, np.zeros(0, dtype=_I64))
        self.gtab = np.full((0, 0), -1, dtype=_I64)  # [slot, metric id] -> sid
        self.n_jobs = self.n_srcs = self.n_sids = self.n_slots = self.n_glut = 0
        self._free: dict[str, list[int]] = {"job": [], "src": [], "sid": [], "slot": []}

    # -- metric names -------------------------------------------------------------------
    def mids(self, names: Sequence[str], family: str = "") -> np.ndarray:
        """Ids of metric names (registered on first use, with the family they belong to)."""
        out = np.empty(len(names), dtype=_I64)
        for i, name in enumerate(names):
            mid = self._mid.get(name)
            if mid is None:
                mid = self._mid[name] = len(self.metric_names)
                self.metric_names.append(name)
                self.metric_family.append(family or name)
                self.metric_arr = np.array(self.metric_names, dtype=object)
            out[i] = mid
        return out

    # -- jobs and sources ---------------------------------------------------------------
    def _take(self, what: str, count: str) -> int:
        free = self._free[what]
        i = free.pop() if free else getattr(self, count)
        setattr(self, count, max(getattr(self, count), i + 1))
        return i

    def source(self, job_id: str, node: str, kind: str) -> Source:
        src = self.sources.get((job_id, node, kind))
        if src is not None:
            return src
        job = self.jobs.get(job_id)
        if job is None:
            j = self._take("job", "n_jobs")
            self.job_name = _grow(self.job_name, j + 1, None)
            self.job_cu = _grow(self.job_cu, j + 1, 0)
            self.job_name[j], self.job_cu[j] = job_id, 0
            job = self.jobs[job_id] = Job(j, job_id)
        i = self._take("src", "n_srcs")
        self.src_node = _grow(self.src_node, i + 1, None)
        for c in self._SRC_COLS:
            setattr(self, c, _grow(getattr(self, c), i + 1, 0))
        self.src_node[i], self.src_job[i] = node, job.idx
        self.src_base[i] = self.src_rn[i] = self.src_dn[i] = 0
        src = self.sources[(job_id, node, kind)] = Source(i, job.idx, node, kind)
        job.sources.append(src)
        return src

    def forget(self, src: Source) -> np.ndarray:
        """Drop a source (and its job when it was the last one); return its freed sids."""
        job = self.jobs[str(self.job_name[src.job])]
        del self.sources[(job.name, src.node, src.kind)]
        job.sources.remove(src)
        i = src.idx
        self._free["src"].append(i)
        self.src_node[i] = None
        seg = self.glut[self.src_base[i] : self.src_base[i] + self.src_rn[i] * self.src_dn[i]]
        slots = seg[seg >= 0]
        seg[:] = -1
        self.src_rn[i] = self.src_dn[i] = 0
        sids = self.gtab[slots][self.gtab[slots] >= 0]
        self.gtab[slots] = -1
        self._free["slot"].extend(slots.tolist())
        self.sid_src[sids] = -1
        self._free["sid"].extend(sorted(sids.tolist(), reverse=True))
        if not job.sources:
            del self.jobs[job.name]
            self._free["job"].append(job.idx)
            self.job_name[job.idx] = None
        live = sum(int(self.src_rn[s.idx]) * int(self.src_dn[s.idx]) for s in self.sources.values())
        if self.n_glut > max(4096, 2 * live):
            self._compact()
        return np.asarray(sids, dtype=_I64)

    def _compact(self) -> None:
        """Rebuild the lookup table from the live sources' segments (dead ones accumulate)."""
        glut = np.full(max(64, self.n_glut), -1, dtype=_I64)
        end = 0
        for s in self.sources.values():
            i = s.idx
            n = int(self.src_rn[i] * self.src_dn[i])
            base = int(self.src_base[i])
            glut[end : end + n] = self.glut[base : base + n]
            self.src_base[i] = end
            end += n
        self.glut, self.n_glut = glut, end

    # -- series ids ---------------------------------------------------------------------
    def sids(
        self, src: np.ndarray, rank: np.ndarray, dev: np.ndarray, mid: np.ndarray
    ) -> np.ndarray:
        """Series id of each sample (source index, rank, device, metric id), registering
        unseen ranks, devices and series."""
        if not len(src):
            return np.zeros(0, dtype=_I64)
        r = rank - self.src_rlo[src]
        d = dev - self.src_dlo[src]
        dn = self.src_dn[src]
        inside = (r >= 0) & (r < self.src_rn[src]) & (d >= 0) & (d < dn)
        if not inside.all():
            self._widen(src[~inside], rank[~inside], dev[~inside])
            return self.sids(src, rank, dev, mid)
        slot = self.glut[self.src_base[src] + r * dn + d]
        if slot.min() < 0:
            miss = slot < 0
            self._new_slots(self.src_base[src][miss] + (r * dn + d)[miss], src[miss])
            slot = self.glut[self.src_base[src] + r * dn + d]
        if mid.max() >= self.gtab.shape[1]:
            t = np.full((self.gtab.shape[0], len(self.metric_names)), -1, dtype=_I64)
            t[:, : self.gtab.shape[1]] = self.gtab
            self.gtab = t
        sid = self.gtab[slot, mid]
        if sid.min() < 0:
            miss = sid < 0
            self._register(slot[miss], mid[miss], rank[miss], dev[miss])
            sid = self.gtab[slot, mid]
        return np.asarray(sid, dtype=_I64)

    def _widen(self, src: np.ndarray, rank: np.ndarray, dev: np.ndarray) -> None:
        """Give sources a segment that also covers these ranks and devices (slots kept)."""
        for i in np.unique(src).tolist():
            m = src == i
            base, rn, dn = (int(a[i]) for a in (self.src_base, self.src_rn, self.src_dn))
            rlo, dlo = int(self.src_rlo[i]), int(self.src_dlo[i])
            nr_lo, nr_hi = int(rank[m].min()), int(rank[m].max())
            nd_lo, nd_hi = int(dev[m].min()), int(dev[m].max())
            if rn:
                nr_lo, nr_hi = min(nr_lo, rlo), max(nr_hi, rlo + rn - 1)
                nd_lo, nd_hi = min(nd_lo, dlo), max(nd_hi, dlo + dn - 1)
            new_rn, new_dn = nr_hi - nr_lo + 1, nd_hi - nd_lo + 1
            new_base = self.n_glut
            self.n_glut += new_rn * new_dn
            self.glut = _grow(self.glut, self.n_glut, -1)
            seg = self.glut[new_base : self.n_glut]
            seg[:] = -1
            if rn:
                old = self.glut[base : base + rn * dn].reshape(rn, dn)
                grid = seg.reshape(new_rn, new_dn)
                grid[rlo - nr_lo : rlo - nr_lo + rn, dlo - nd_lo : dlo - nd_lo + dn] = old
                old[:] = -1
            self.src_base[i], self.src_rn[i], self.src_dn[i] = new_base, new_rn, new_dn
            self.src_rlo[i], self.src_dlo[i] = nr_lo, nd_lo

    def _new_slots(self, where: np.ndarray, src: np.ndarray) -> None:
        where, first = np.unique(where, return_index=True)
        slots = np.array([self._take("slot", "n_slots") for _ in range(len(where))], dtype=_I64)
        self.slot_src = _grow(self.slot_src, self.n_slots, -1)
        self.slot_src[slots] = src[first]
        if self.n_slots > self.gtab.shape[0]:
            t = np.full((max(self.n_slots, 2 * self.gtab.shape[0], 64), self.gtab.shape[1]), -1)
            t[: self.gtab.shape[0]] = self.gtab
            self.gtab = t.astype(_I64)
        self.glut[where] = slots

    def _register(
        self, slot: np.ndarray, mid: np.ndarray, rank: np.ndarray, dev: np.ndarray
    ) -> None:
        ncol = self.gtab.shape[1]
        pairs, first = np.unique(slot * ncol + mid, return_index=True)
        k = len(pairs)
        sid = np.array([self._take("sid", "n_sids") for _ in range(k)], dtype=_I64)
        for c in self._SID_COLS:
            setattr(self, c, _grow(getattr(self, c), self.n_sids, -1))
        s, m = pairs // ncol, pairs % ncol
        src = self.slot_src[s]
        job = self.src_job[src]
        self.sid_src[sid], self.sid_job[sid] = src, job
        self.sid_rank[sid], self.sid_dev[sid], self.sid_mid[sid] = rank[first], dev[first], m
        family, names = self.metric_family, self.job_name
        self.sid_since[sid] = [
            self.jobs[names[j]].family_since.get(family[f], _ALWAYS)
            for j, f in zip(job.tolist(), m.tolist(), strict=True)
        ]
        self.gtab[s, m] = sid

    # -- snapshots ----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        d: dict[str, Any] = {c: getattr(self, c).copy() for c in self._ARRAYS}
        d.update(
            gtab=self.gtab.copy(),
            job_name=self.job_name.copy(),
            src_node=self.src_node.copy(),
            metric_names=list(self.metric_names),
            metric_family=list(self.metric_family),
            jobs=[
                {
                    "idx": j.idx,
                    "name": j.name,
                    "sources": [s.idx for s in j.sources],
                    "spec_since": dict(j.spec_since),
                    "born": j.born,
                    "family_since": dict(j.family_since),
                }
                for j in self.jobs.values()
            ],
            sources=[s.state() for s in self.sources.values()],
            free={k: list(v) for k, v in self._free.items()},
            counts=(self.n_jobs, self.n_srcs, self.n_sids, self.n_slots, self.n_glut),
        )
        return d

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> Registry:
        r = cls()
        for c in (*cls._ARRAYS, "gtab", "job_name", "src_node"):
            setattr(r, c, d[c].copy())
        r.metric_names, r.metric_family = list(d["metric_names"]), list(d["metric_family"])
        r._mid = {n: i for i, n in enumerate(r.metric_names)}
        r.metric_arr = np.array(r.metric_names, dtype=object)
        r.n_jobs, r.n_srcs, r.n_sids, r.n_slots, r.n_glut = d["counts"]
        r._free = {k: list(v) for k, v in d["free"].items()}
        by_idx = {}
        for sd in d["sources"]:
            src = by_idx[sd["idx"]] = Source.from_state(sd)
            r.sources[(str(r.job_name[src.job]), src.node, src.kind)] = src
        for jd in d["jobs"]:
            job = Job(jd["idx"], jd["name"])
            job.sources = [by_idx[i] for i in jd["sources"]]
            job.spec_since = dict(jd["spec_since"])
            job.born = jd.get("born", -1)
            job.family_since = dict(jd["family_since"])
            r.jobs[job.name] = job
        return r
