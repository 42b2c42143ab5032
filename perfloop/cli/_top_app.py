"""The Textual app of `perfloop top`: a job picker and the selected job's live detail.

Left, the jobs seen (running ones first); Enter picks one. Right, the picked job: a line at a
glance (state, ranks and nodes, run phase, step time, steps/s, when last heard from), its
ranks (step time, phase shares, GPU and CPU use), its open diagnoses, the changes made to it
(commands, their acks and verdicts) and its recommendations. Every `TopApp.REFRESH_S` it takes
what the feed decoded into its `TopState` and redraws; picking a job reads its recent state
from the warehouse first (in a worker thread), so it shows numbers at once. ``q`` quits.

What is shown is `TopState`'s; this module only lays it out.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, ClassVar

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.widgets import DataTable, Footer, Static

from perfloop.cli._jobs_rows import ago, ranks_text
from perfloop.cli._top_state import PHASE_COLUMNS, TopState

__all__ = ["TopApp"]

_PHASE_HEADS = {"data_wait": "DATA%", "forward": "FWD%", "backward": "BWD%", "comm": "COMM%",
                "optimizer": "OPT%", "other": "OTHER%"}  # fmt: skip
_STATE_STYLE = {"running": "green", "silent": "yellow", "failed": "red", "killed": "yellow",
                "finished": "dim", "waiting": "dim"}  # fmt: skip
_HEADS = {
    "jobs": ("", "JOB", "STATE", "RANKS", "STEP ms", "STEP/s", "OPEN DIAGNOSES", "LAST CHANGE",
             "SEEN"),
    "ranks": ("RANK", "NODE", "STEP", "STEP ms", "LAST ms", "STEP/s",
              *(_PHASE_HEADS[p] for p in (*PHASE_COLUMNS, "other")), "GPU%", "GMEM%", "CPU%",
              "LOADER%"),
    "diagnoses": ("BOTTLENECK", "LEVEL", "RANKS", "SHARE", "CRITICAL", "OPEN FOR", "SUMMARY"),
    "changes": ("WHEN", "KNOB", "FROM → TO", "STATUS", "AT STEP", "p50 BEFORE → AFTER", "REASON"),
    "recs": ("WHEN", "KNOB", "FROM → TO", "GAIN", "CONF", "OUTCOME", "RATIONALE"),
}  # fmt: skip


def _num(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def _cut(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


class TopApp(App[None]):
    """`perfloop top`'s terminal view over a `TopState`, fed by a feed (``drain()``)."""

    TITLE = "perfloop top"
    REFRESH_S = 1.0
    JOBS_REFRESH_S = 15.0
    """How often the job list is read again from the warehouse."""
    CSS = """
    Screen { layout: vertical; }
    #glance { height: 2; padding: 0 1; }
    #jobs { height: auto; max-height: 9; border: round $primary; }
    #ranks { height: 1fr; min-height: 5; border: round $secondary; }
    #diagnoses { height: auto; max-height: 9; border: round $secondary; }
    #changes { height: auto; max-height: 8; border: round $secondary; }
    #recs { height: auto; max-height: 8; border: round $secondary; }
    #note { height: 1; padding: 0 1; color: $warning; }
    """
    BINDINGS: ClassVar[list[Any]] = [
        Binding("q", "quit", "quit"),
        Binding("ctrl+c", "quit", "quit", show=False, priority=True),
        Binding("j", "focus_jobs", "jobs"),
        Binding("r", "reload", "reload job"),
    ]

    def __init__(
        self,
        state: TopState,
        feed: Any,
        *,
        job: str | None = None,
        seed: Callable[[str], Any] | None = None,
        jobs: Callable[[], Any] | None = None,
        note: str = "",
        now: Callable[[], int] = time.time_ns,
    ) -> None:
        super().__init__()
        self.state, self.feed, self.seed_of, self.now = state, feed, seed, now
        self.jobs_of = jobs
        """The recent jobs' rows from the warehouse (`perfloop jobs`' `load_jobs`), read again
        every `JOBS_REFRESH_S`: the list's step time and steps/s of the jobs not picked (the
        feed decodes only the picked job's telemetry)."""
        self.selected = job
        self.picked_by_user = job is not None
        self.note, self.loading = note, ""
        self._order: list[str] = []

    def compose(self) -> ComposeResult:
        yield Static(id="glance")
        yield DataTable(id="jobs", cursor_type="row")
        yield DataTable(id="ranks", cursor_type="none", zebra_stripes=True)
        yield DataTable(id="diagnoses", cursor_type="none")
        yield DataTable(id="changes", cursor_type="none")
        yield DataTable(id="recs", cursor_type="none")
        yield Static(id="note")
        yield Footer()

    def on_mount(self) -> None:
        titles = {"jobs": "jobs (↑/↓, enter: show)", "ranks": "ranks (phases: % of the step)",
                  "diagnoses": "open diagnoses", "changes": "changes",
                  "recs": "recommendations"}  # fmt: skip
        for name, title in titles.items():
            self.query_one(f"#{name}", DataTable).border_title = title
        self.query_one("#jobs", DataTable).focus()
        if self.selected is not None:
            self._select(self.selected)
        self.tick()
        self.set_interval(self.REFRESH_S, self.tick)
        if self.jobs_of is not None:
            self.set_interval(self.JOBS_REFRESH_S, self._refresh_jobs)

    def _refresh_jobs(self) -> None:
        jobs_of = self.jobs_of
        if jobs_of is not None:
            self.run_worker(lambda: self._load_jobs(jobs_of), thread=True, exclusive=True,
                            group="jobs")  # fmt: skip

    def _load_jobs(self, jobs_of: Callable[[], Any]) -> None:
        from perfloop.exceptions import PerfloopError

        try:
            rows = jobs_of()
        except PerfloopError:
            return  # the list goes on with the live events; the next refresh tries again
        if self.is_running:
            with contextlib.suppress(RuntimeError):  # the app closed meanwhile
                self.call_from_thread(self._jobs_loaded, rows)

    def _jobs_loaded(self, rows: Any) -> None:
        if not self.is_running:  # quitting: its widgets may be gone
            return
        self.state.seed_jobs(rows)
        with contextlib.suppress(NoMatches):
            self.tick()

    # -- actions -----------------------------------------------------------------------------

    def action_focus_jobs(self) -> None:
        self.query_one("#jobs", DataTable).focus()

    def action_reload(self) -> None:
        if self.selected is not None:
            self._select(self.selected)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.data_table.id == "jobs" and event.row_key.value is not None:
            self.picked_by_user = True
            self._select(str(event.row_key.value))

    def _select(self, job: str) -> None:
        self.selected = job
        self.feed.select(job)
        self.state.job(job)
        if self.seed_of is not None:
            self.loading = f"reading {job}'s recent state from the warehouse…"
            seed_of = self.seed_of
            self.run_worker(lambda: self._load(seed_of, job), thread=True, exclusive=True,
                            group="seed")  # fmt: skip
        self.render_view()

    def _load(self, seed_of: Callable[[str], Any], job: str) -> None:
        from perfloop.exceptions import PerfloopError

        try:
            seed = seed_of(job)
        except PerfloopError as e:
            self.call_from_thread(self._set_note, f"warehouse: {e} (live events only)")
            return
        self.call_from_thread(self._seeded, seed)

    def _seeded(self, seed: Any) -> None:
        if seed.job_id == self.selected:
            self.loading = ""
        self.note = ""  # the warehouse answered
        seed.apply(self.state)
        self.render_view()

    def _set_note(self, text: str) -> None:
        self.note, self.loading = text, ""
        self.render_view()

    # -- drawing -----------------------------------------------------------------------------

    def tick(self) -> None:
        """Take what the feed decoded, then redraw. While nobody picked a job, the first
        running one is shown (a job started after `perfloop top` included)."""
        for item in self.feed.drain():
            self.state.apply(item)
        if not self.picked_by_user:
            running = next(
                (x.job_id for x in self.state.job_lines(self.now()) if x.state == "running"), None
            )
            if running is not None and running != self.selected:
                self._select(running)
                return
        self.render_view()

    def render_view(self) -> None:
        now = self.now()
        self._render_jobs(now)
        self._render_glance(now)
        job = self.selected
        for name, rows in (
            ("ranks", self._rank_rows(job)),
            ("diagnoses", self._diagnosis_rows(job, now)),
            ("changes", self._change_rows(job, now)),
            ("recs", self._rec_rows(job, now)),
        ):
            _fill(self.query_one(f"#{name}", DataTable), name, rows)
        bad = getattr(self.feed, "bad", 0)
        extra = f"{bad} undecodable messages skipped" if bad else ""
        self.query_one("#note", Static).update(
            " · ".join(x for x in (self.loading, self.note, extra) if x)
        )

    def _render_jobs(self, now: int) -> None:
        t = self.query_one("#jobs", DataTable)
        at = self._order[t.cursor_row] if 0 <= t.cursor_row < len(self._order) else self.selected
        lines = self.state.job_lines(now)
        _fill(t, "jobs", [])
        self._order = []
        for x in lines:
            style = _STATE_STYLE.get(x.state, "")
            state = x.state if x.exit_code in (None, 0) else f"{x.state} ({x.exit_code})"
            diags = ", ".join(d.text() for d in x.diagnoses[:2])
            more = len(x.diagnoses) - 2
            t.add_row(
                "▶" if x.job_id == self.selected else "",
                _cut(x.job_id, 36),
                f"[{style}]{state}[/]" if style else state,
                str(x.ranks) if x.ranks else "-",
                _num(x.step_ms),
                _num(x.steps_per_s, ".2f"),
                _cut(diags + (f" (+{more})" if more > 0 else ""), 48) or "-",
                _cut(x.last_change, 36) or "-",
                f"{ago(x.last_ns, now)} ago" if x.last_ns else "-",
                key=x.job_id,
            )
            self._order.append(x.job_id)
        if at in self._order:
            t.move_cursor(row=self._order.index(at), scroll=False)

    def _render_glance(self, now: int) -> None:
        glance = self.query_one("#glance", Static)
        job = self.selected
        if job is None:
            glance.update(
                "[b]perfloop top[/b]  no job picked: pick one on the left (↑/↓, enter)"
                if self._order else "[b]perfloop top[/b]  no jobs seen yet; waiting for one"
            )  # fmt: skip
            return
        s = self.state.summary(job, now)
        style = _STATE_STYLE.get(s.state, "")
        state = s.state if s.exit_code in (None, 0) else f"{s.state} (exit {s.exit_code})"
        parts = [
            f"[b]{job}[/b]  [{style}]{state}[/]" if style else f"[b]{job}[/b]  {state}",
            f"{s.ranks} rank{'s' * (s.ranks != 1)} on {s.nodes} node{'s' * (s.nodes != 1)}",
        ]
        if s.model:
            parts.append(s.model)
        if s.run_phase:
            parts.append(f"run phase {s.run_phase}")
        parts += [
            f"step p50 [b]{_num(s.step_ms)} ms[/b]",
            f"{_num(s.steps_per_s, '.2f')} steps/s",
            f"seen {ago(s.last_ns, now)} ago" if s.last_ns else "not seen yet",
        ]
        diags = self.state.diagnoses(job)
        worst = (
            f"bottleneck: [b]{diags[0].bottleneck}[/b] ({100 * diags[0].step_share:.0f}% of the "
            "step)" if diags else "no open diagnosis"
        )  # fmt: skip
        glance.update("  ·  ".join(parts) + "\n" + worst)

    def _rank_rows(self, job: str | None) -> list[tuple[str, ...]]:
        if job is None:
            return []
        out = []
        for r in self.state.rank_lines(job):
            shares = [_num(100 * r.shares[p], ".0f") if r.shares else "-"
                      for p in (*PHASE_COLUMNS, "other")]  # fmt: skip
            out.append((
                str(r.rank), _cut(r.node, 24), str(r.step), _num(r.step_ms), _num(r.last_ms),
                _num(r.steps_per_s, ".2f"), *shares, _num(r.gpu_util_pct, ".0f"),
                _num(r.gpu_mem_pct, ".0f"), _num(r.cpu_pct, ".0f"), _num(r.loader_cpu_pct, ".0f"),
            ))  # fmt: skip
        return out

    def _diagnosis_rows(self, job: str | None, now: int) -> list[tuple[str, ...]]:
        if job is None:
            return []
        return [
            (
                d.bottleneck,
                d.level,
                ranks_text(d.ranks) if d.ranks else "all",
                f"{100 * d.step_share:.0f}%",
                "yes" if d.critical_path else (f"no: {d.explained_by}" if d.explained_by else "no"),
                ago(d.onset_ns, now) if d.onset_ns else "-",
                _cut(d.summary, 90),
            )
            for d in self.state.diagnoses(job)
        ]

    def _change_rows(self, job: str | None, now: int) -> list[tuple[str, ...]]:
        if job is None:
            return []
        out = []
        for c in self.state.changes(job):
            before_after = (
                f"{c.before_ms:.1f} → {c.after_ms:.1f} ms"
                if c.before_ms is not None and c.after_ms is not None else ""
            )  # fmt: skip
            out.append((
                f"{ago(c.ts_ns, now)} ago", c.knob, f"{c.from_value or '?'} → {c.to_value}",
                c.status.replace("_", " "), str(c.step) if c.step else "", before_after,
                _cut(c.reason, 70),
            ))  # fmt: skip
        return out

    def _rec_rows(self, job: str | None, now: int) -> list[tuple[str, ...]]:
        if job is None:
            return []
        return [
            (
                f"{ago(r.ts_ns, now)} ago", r.knob, f"{r.from_value} → {r.to_value}",
                f"{r.expected_gain_pct:.0f}%", f"{r.confidence:.2f}", r.outcome or "-",
                _cut(r.rationale, 80),
            )
            for r in self.state.recommendations(job)
        ]  # fmt: skip


def _fill(t: DataTable[Any], name: str, rows: list[tuple[str, ...]]) -> None:
    """Replace the table's rows, and its columns: a column narrows again when its widest cell
    is gone."""
    t.clear(columns=True)
    t.add_columns(*_HEADS[name])
    t.add_rows(rows)
