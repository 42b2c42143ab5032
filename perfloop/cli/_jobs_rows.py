"""What `perfloop jobs` shows about each job, built from warehouse rows: pure functions, no I/O.

A job's state comes from its lifecycle events and its last telemetry (`job_state`): a job whose
ranks or wrapper said ``failed`` is ``failed``; else one that said ``killed`` (stopped by a
signal: a person's Ctrl-C, a scheduler's cancel) is ``killed``; one that said ``finished`` is
``finished``; otherwise it is ``running`` while it was seen in the last `SILENT_AFTER_S`
seconds and ``silent`` after. `build_rows` joins the per-job aggregates of each query into
`JobRow`s; `to_json` and `render_table` print them for scripts and for people.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "SILENT_AFTER_S",
    "ChangeSummary",
    "DiagnosisSummary",
    "JobRow",
    "ago",
    "build_rows",
    "job_state",
    "parse_duration",
    "ranks_text",
    "render_table",
    "to_json",
    "verdict",
]

NS = 1_000_000_000
SILENT_AFTER_S = 60.0
"""A job not terminated and not seen for this long is ``silent`` (its producers stopped
publishing: the process hung hard, its node is gone, or the broker is unreachable from it)."""

_ENDED = {"finished": "finished", "failed": "failed", "killed": "killed"}
_VERDICTS = {"kept": "kept", "rolled_back": "rolled back", "rejected": "rejected"}
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")


def parse_duration(text: str) -> float:
    """Seconds in a duration written ``30s``, ``15m``, ``2h``, ``1d`` or ``1w``.

    >>> parse_duration("1d"), parse_duration("90s"), parse_duration("1.5h")
    (86400.0, 90.0, 5400.0)
    """
    m = _DURATION.match(text)
    if m is None or float(m[1]) <= 0:
        raise ValueError(
            f"invalid duration {text!r}: use a positive number and a unit, one of "
            "s, m, h, d, w (e.g. 30m, 1d)"
        )
    return float(m[1]) * _UNITS[m[2]]


@dataclass(frozen=True, slots=True)
class DiagnosisSummary:
    """One bottleneck still open for a job: what, where, and its share of the step."""

    bottleneck: str
    level: str
    ranks: tuple[int, ...]
    step_share: float
    critical_path: bool
    explained_by: str = ""
    diagnosis_id: str = ""
    summary: str = ""
    onset_ns: int = 0

    def text(self) -> str:
        """``dataloader_starvation r0-3 42%`` (``all`` for a job-wide one)."""
        where = f"r{ranks_text(self.ranks)}" if self.ranks else "all"
        return f"{self.bottleneck} {where} {100 * self.step_share:.0f}%"


@dataclass(frozen=True, slots=True)
class ChangeSummary:
    """The last command sent to a job, and what became of it (`verdict`)."""

    knob: str
    from_value: str
    to_value: str
    verdict: str
    ts_ns: int

    def text(self) -> str:
        """``dataloader.num_workers 0→1 kept``."""
        before = self.from_value if self.from_value != "" else "?"
        return f"{self.knob} {before}→{self.to_value} {self.verdict}"


@dataclass(frozen=True, slots=True)
class JobRow:
    """One job as `perfloop jobs` lists it."""

    job_id: str
    state: str
    ranks: int | None
    nodes: int | None
    step_time_ms: float | None
    steps_per_s: float | None
    started_ns: int | None
    last_seen_ns: int
    exit_code: int | None = None
    diagnoses: tuple[DiagnosisSummary, ...] = field(default_factory=tuple)
    last_change: ChangeSummary | None = None


def verdict(status: str) -> str:
    """What became of a command, from its latest ack status: ``kept``, ``rolled back``,
    ``rejected``, or ``pending`` (not acked yet, or applied and being verified).

    >>> verdict("rolled_back"), verdict("applied"), verdict("")
    ('rolled back', 'pending', 'pending')
    """
    return _VERDICTS.get(status, "pending")


def job_state(
    lifecycle: Iterable[tuple[int, str, int | None]],
    last_seen_ns: int,
    now_ns: int,
    *,
    silent_after_s: float = SILENT_AFTER_S,
) -> tuple[str, int | None]:
    """The job's state and exit code from each rank's latest lifecycle ``(rank, state,
    exit_code)`` (rank -1: the whole job) and when it was last seen.

    >>> now = 100 * NS
    >>> job_state([(-1, "started", None), (0, "failed", 1)], now, now)
    ('failed', 1)
    >>> job_state([(-1, "killed", 130), (0, "finished", 0)], now, now)
    ('killed', 130)
    >>> job_state([(0, "finished", 0), (1, "finished", 0)], now, now)
    ('finished', 0)
    >>> job_state([(-1, "started", None)], now - 61 * NS, now)
    ('silent', None)
    >>> job_state([], now, now)
    ('running', None)
    """
    latest = {rank: (state, code) for rank, state, code in lifecycle}
    for end in ("failed", "killed"):
        ended = [(s, c) for s, c in latest.values() if _ENDED.get(s) == end]
        if ended:
            return end, next((c for _, c in ended if c is not None), None)
    whole = latest.get(-1)
    if whole is not None and whole[0] == "finished":
        return "finished", whole[1]
    ranks = [v for r, v in latest.items() if r >= 0]
    if whole is None and ranks and all(s == "finished" for s, _ in ranks):
        return "finished", next((c for _, c in ranks if c is not None), None)
    if now_ns - last_seen_ns > silent_after_s * NS:
        return "silent", None
    return "running", None


def ranks_text(ranks: Sequence[int]) -> str:
    """Ranks as ranges: ``0-3,7``.

    >>> ranks_text([3, 0, 1, 2, 7, 9, 10])
    '0-3,7,9-10'
    """
    out: list[str] = []
    rs = sorted(set(ranks))
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)


def ago(ts_ns: int | None, now_ns: int) -> str:
    """How long ago, in the largest unit: ``4s``, ``12m``, ``3h``, ``2d`` (``-`` if unknown).

    >>> ago(0, 125 * NS), ago(None, 1)
    ('2m', '-')
    """
    if ts_ns is None:
        return "-"
    s = max(0.0, (now_ns - ts_ns) / NS)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{int(s // size)}{unit}"
    return f"{int(s)}s"


def build_rows(
    seen: Mapping[str, tuple[int, int]],
    lifecycle: Mapping[str, list[tuple[int, str, int | None, int]]],
    info: Mapping[str, tuple[int, int]],
    steps: Mapping[str, tuple[float, float | None, int, int]],
    diagnoses: Mapping[str, list[DiagnosisSummary]],
    changes: Mapping[str, ChangeSummary],
    now_ns: int,
    *,
    silent_after_s: float = SILENT_AFTER_S,
) -> list[JobRow]:
    """Join each query's per-job answer into rows, the most recently seen job first.

    ``seen``: job → (first, last) time seen in telemetry or events; ``lifecycle``: job → each
    rank's latest (rank, state, exit_code, first_ts_ns); ``info``: job → (world size, nodes)
    from `JobInfo`; ``steps``: job → (median step ms, steps/s or None, ranks, nodes) of its
    recent steps; ``diagnoses``: job → open ones; ``changes``: job → its last command.
    """
    rows = []
    for job, (first, last) in seen.items():
        life = lifecycle.get(job, [])
        state, code = job_state(
            [(r, s, c) for r, s, c, _ in life], last, now_ns, silent_after_s=silent_after_s
        )
        started = min([first, *(t for *_, t in life)])
        world, n_nodes = info.get(job, (0, 0))
        step = steps.get(job)
        ranks = world or (step[2] if step else 0)
        nodes = n_nodes or (step[3] if step else 0)
        diags = sorted(diagnoses.get(job, []), key=lambda d: (not d.critical_path, -d.step_share))
        rows.append(
            JobRow(
                job_id=job,
                state=state,
                ranks=ranks or None,
                nodes=nodes or None,
                step_time_ms=step[0] if step else None,
                steps_per_s=step[1] if step else None,
                started_ns=started,
                last_seen_ns=last,
                exit_code=code,
                diagnoses=tuple(diags),
                last_change=changes.get(job),
            )
        )
    rows.sort(key=lambda r: (r.state not in ("running", "silent"), -r.last_seen_ns, r.job_id))
    return rows


def _iso(ts_ns: int | None) -> str | None:
    if ts_ns is None:
        return None
    t = datetime.datetime.fromtimestamp(ts_ns / NS, tz=datetime.UTC)
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def to_json(rows: Sequence[JobRow]) -> list[dict[str, Any]]:
    """Each row as a JSON-ready dict (times as ISO-8601 UTC and as Unix ns)."""
    out = []
    for r in rows:
        c = r.last_change
        out.append(
            {
                "job_id": r.job_id,
                "state": r.state,
                "exit_code": r.exit_code,
                "ranks": r.ranks,
                "nodes": r.nodes,
                "step_time_ms": None if r.step_time_ms is None else round(r.step_time_ms, 3),
                "steps_per_s": None if r.steps_per_s is None else round(r.steps_per_s, 3),
                "diagnoses": [
                    {
                        "bottleneck": d.bottleneck,
                        "level": d.level,
                        "ranks": list(d.ranks),
                        "step_share": round(d.step_share, 4),
                        "critical_path": d.critical_path,
                        "explained_by": d.explained_by,
                        "diagnosis_id": d.diagnosis_id,
                        "summary": d.summary,
                    }
                    for d in r.diagnoses
                ],
                "last_change": None
                if c is None
                else {
                    "knob": c.knob,
                    "from_value": c.from_value,
                    "to_value": c.to_value,
                    "verdict": c.verdict,
                    "ts": _iso(c.ts_ns),
                },
                "started": _iso(r.started_ns),
                "started_ns": r.started_ns,
                "last_seen": _iso(r.last_seen_ns),
                "last_seen_ns": r.last_seen_ns,
            }
        )
    return out


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


_STATE_STYLE = {
    "running": "green",
    "silent": "yellow",
    "failed": "red",
    "killed": "yellow",
    "finished": "dim",
}


_HEADS = ("JOB", "STATE", "RANKS", "NODES", "STEP ms", "STEP/s", "OPEN DIAGNOSES",
          "LAST CHANGE", "AGE", "SEEN")  # fmt: skip
_FLEXIBLE = (0, 6, 7)  # job, diagnoses, change: the columns that wrap
_GAP = 2


def _cells(r: JobRow, now_ns: int) -> list[str]:
    state = r.state if r.exit_code in (None, 0) else f"{r.state} ({r.exit_code})"
    return [
        r.job_id,
        state,
        _num(r.ranks, "d"),
        _num(r.nodes, "d"),
        _num(r.step_time_ms, ".1f"),
        _num(r.steps_per_s, ".2f"),
        "\n".join(d.text() for d in r.diagnoses) or "-",
        r.last_change.text() if r.last_change else "-",
        ago(r.started_ns, now_ns),
        ago(r.last_seen_ns, now_ns),
    ]


def fit_widths(cells: Sequence[Sequence[str]], width: int) -> list[int]:
    """Column widths for ``cells`` (header first) within ``width`` with `_GAP` between: the
    fixed columns as wide as their widest cell; when the rest does not fit, the diagnoses and
    the change narrow first, down to their longest word (they wrap between words), then down
    to 12 (a long word folds), then the job column, down to 12 (an id folds: ids are what a
    user copies, so they fold last), and only then any of them further.
    """
    n = len(cells[0])
    lines = [[line for row in cells for line in row[i].split("\n")] for i in range(n)]
    natural = [max(len(x) for x in col) for col in lines]
    word = [max(len(w) for x in col for w in (x.split() or [""])) for col in lines]
    flexible = [i for i in _FLEXIBLE if i < n]
    widths = list(natural)
    excess = sum(widths) + _GAP * (n - 1) - width
    floors = [(flexible[1:], lambda i: word[i]), (flexible[1:], lambda i: min(natural[i], 12)),
              (flexible[:1], lambda i: min(natural[i], 12)), (flexible, lambda i: 1)]  # fmt: skip
    for cols, floor in floors:
        while excess > 0:
            room = [i for i in cols if widths[i] > floor(i)]
            if not room:
                break
            widest = max(room, key=lambda i: widths[i])
            widths[widest] -= 1
            excess -= 1
    return widths


def render_table(
    rows: Sequence[JobRow], now_ns: int, *, width: int = 120, color: bool = False
) -> str:
    """The rows as an aligned table at most ``width`` characters wide (rich)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    cells = [_cells(r, now_ns) for r in rows]
    widths = fit_widths([_HEADS, *cells], width)
    t = Table(
        box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, _GAP - 1, 0, 0), show_edge=False,
        caption="AGE: since it started; SEEN: how long ago", caption_justify="left",
    )  # fmt: skip
    for i, head in enumerate(_HEADS):
        right = head in ("RANKS", "NODES", "STEP ms", "STEP/s", "AGE", "SEEN")
        t.add_column(head, justify="right" if right else "left", width=widths[i],
                     overflow="fold", no_wrap=i not in _FLEXIBLE)  # fmt: skip
    for r, row in zip(rows, cells, strict=True):
        style = _STATE_STYLE.get(r.state, "")
        row[1] = f"[{style}]{row[1]}[/]" if style else row[1]
        t.add_row(*row)
    console = Console(
        width=width, color_system="standard" if color else None, force_terminal=color,
        highlight=False,
    )  # fmt: skip
    with console.capture() as cap:
        console.print(t)
    return "\n".join(line.rstrip() for line in cap.get().splitlines()).strip("\n")
