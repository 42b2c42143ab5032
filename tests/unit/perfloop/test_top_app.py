"""``perfloop top``'s terminal view, headless (Textual's pilot): fed a simulated job's real
decoded batches and the loop's events, it shows the job's ranks and step time, its open
diagnosis and its change; the picker switches jobs (reading the picked one's recent state
from its seed) and ``q`` quits."""

from __future__ import annotations

import asyncio
from typing import Any

from rich.text import Text
from textual.widgets import DataTable, Static

from perfloop.cli._top_app import TopApp
from perfloop.cli._top_lines import Seen
from perfloop.cli._top_seed import JobSeed
from perfloop.cli._top_state import TopState
from perfloop.schemas import ActuationResult, Command, Diagnosis
from tests.helpers import simulate

NS = 1_000_000_000


class ListFeed:
    """The feed's interface over a list of decoded items (what `TopicFeed` hands over)."""

    def __init__(self, items: list[Any]) -> None:
        self.items, self.selected, self.bad = list(items), None, 0

    def select(self, job: str | None) -> None:
        self.selected = job

    def drain(self) -> list[Any]:
        out, self.items = self.items, []
        return out


def _cells(app: TopApp, table: str) -> list[list[str]]:
    t = app.query_one(f"#{table}", DataTable)
    return [[Text.from_markup(str(c)).plain for c in t.get_row_at(i)] for i in range(t.row_count)]


def test_the_view_shows_the_job_and_the_picker_switches_jobs() -> None:
    cfg, messages = simulate("straggler", 12.0, job_id="sim-top")
    end = max(m.ts_ns for m in messages if hasattr(m, "ts_ns"))
    common = {"ts_ns": end, "job_id": "sim-top", "node": cfg.node_names[0], "rank": -1}
    diagnosis = Diagnosis(**common, diagnosis_id="d1", bottleneck="straggler", level="network",
                          loop="training", state="open", onset_ns=end - 4 * NS, step_share=0.39,
                          confidence=0.9, critical_path=True, ranks=[1],
                          summary="rank 1 computes 1.7x the job median")  # fmt: skip
    cmd = Command(**common, seq=1, knob="cluster.drain_node", from_value="", value="node-0",
                  expires_ts_ns=end + NS)  # fmt: skip
    ack = ActuationResult(**(common | {"rank": 0}), command_id=cmd.event_id, status="applied",
                          knob=cmd.knob, value="node-0", step=90)  # fmt: skip
    other = JobSeed("other-job", steps=[("n9", 0, end - NS, 5, 250.0, 0.0),
                                        ("n9", 0, end, 6, 250.0, 0.0)])  # fmt: skip
    seeded: list[str] = []

    def seed(job: str) -> JobSeed:
        seeded.append(job)
        return other if job == other.job_id else JobSeed(job)

    state = TopState()
    state.apply(Seen("other-job", end - 30 * NS))  # heard of, its telemetry not decoded
    feed = ListFeed([*messages, diagnosis, cmd, ack])
    app = TopApp(state, feed, job="sim-top", seed=seed, now=lambda: end + NS)

    async def drive() -> None:
        async with app.run_test(size=(160, 45)) as pilot:
            await pilot.pause()
            await app.workers.wait_for_complete()
            await pilot.pause()
            glance = Text.from_markup(str(app.query_one("#glance", Static).content)).plain
            p50 = state.summary("sim-top").step_ms
            assert p50 is not None
            assert "sim-top" in glance and f"step p50 {p50:.1f} ms" in glance
            assert "bottleneck: straggler (39% of the step)" in glance
            ranks = _cells(app, "ranks")
            assert [r[0] for r in ranks] == ["0", "1", "2", "3"]
            for row, line in zip(ranks, state.rank_lines("sim-top"), strict=True):
                assert row[3] == f"{line.step_ms:.1f}"  # STEP ms
            (diag,) = _cells(app, "diagnoses")
            assert diag[:5] == ["straggler", "network", "1", "39%", "yes"]
            (change,) = _cells(app, "changes")
            assert change[1:5] == ["cluster.drain_node", "? → node-0", "applied", "90"]
            # the simulation ended: the job still heard from first; the cursor on the one shown
            jobs = _cells(app, "jobs")
            assert [(j[0], j[1], j[2]) for j in jobs] == [
                ("", "other-job", "running"), ("▶", "sim-top", "finished")
            ]  # fmt: skip
            assert app.query_one("#jobs", DataTable).cursor_row == 1

            await pilot.press("up", "enter")  # pick the other job
            await app.workers.wait_for_complete()
            await pilot.pause()
            assert (app.selected, feed.selected) == ("other-job", "other-job")
            assert seeded == ["sim-top", "other-job"]
            assert [r[:4] for r in _cells(app, "ranks")] == [["0", "n9", "6", "250.0"]]
            assert _cells(app, "diagnoses") == []
            await pilot.press("q")
            await pilot.pause()
        assert not app.is_running

    asyncio.run(drive())


def test_a_job_that_starts_later_is_shown_and_the_list_is_read_again() -> None:
    """Started before any job runs, the view shows the first job that runs (nobody picked
    one); the job list's step time of a job it does not show comes from the warehouse, read
    again every `JOBS_REFRESH_S`."""
    from perfloop.cli._jobs_rows import JobRow

    _cfg, messages = simulate("healthy", 6.0, job_id="sim-late")
    end = max(m.ts_ns for m in messages if hasattr(m, "ts_ns"))
    # still running: its end left out
    messages = [m for m in messages if getattr(m, "state", "started") in ("started", "running")]
    feed = ListFeed([])
    reads: list[int] = []
    started: list[bool] = []  # the warehouse knows of no job until the jobs start

    def jobs() -> list[JobRow]:
        reads.append(1)
        if not started:
            return []
        return [JobRow("elsewhere", "finished", 2, 1, 123.0, 8.0, end - 60 * NS, end - NS)]

    state = TopState()
    app = TopApp(state, feed, jobs=jobs, seed=lambda j: JobSeed(j), now=lambda: end + NS)
    app.JOBS_REFRESH_S = 0.05

    async def drive() -> None:
        async with app.run_test(size=(160, 45)) as pilot:
            await pilot.pause()
            assert app.selected is None  # nothing runs yet
            feed.items = list(messages)  # the jobs start
            started.append(True)
            for _ in range(100):  # up to 10 s on a busy machine: the next refreshes
                listed = {x.job_id for x in state.job_lines(end + NS)}
                if app.selected is not None and "elsewhere" in listed:
                    break
                await pilot.pause(0.1)
            await pilot.pause(0.2)  # drawn (a refresh may be cancelled by the next: exclusive)
            assert app.selected == "sim-late" and reads
            rows = {r[1]: r for r in _cells(app, "jobs")}
            assert rows["elsewhere"][4:6] == ["123.0", "8.00"], rows["elsewhere"]

    asyncio.run(drive())
