"""``perfloop jobs``: a job's state from its lifecycle and last telemetry, the rows joined from
each query's answer, the table for people (aligned, at most 120 characters) and the JSON for
scripts, and its one-line failures (no stack)."""

from __future__ import annotations

import json

import pytest

from perfloop.cli import build_parser, main
from perfloop.cli._jobs_rows import (
    ChangeSummary,
    DiagnosisSummary,
    build_rows,
    job_state,
    parse_duration,
    ranks_text,
    render_table,
    to_json,
)
from tests.helpers import clean_env, closed_port, one_line  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("clean_env")

NS = 1_000_000_000
NOW = 1_800_000_000 * NS


@pytest.mark.parametrize(
    ("lifecycle", "seen_s_ago", "expected"),
    [
        ([(-1, "started", None), (0, "running", None)], 2, ("running", None)),
        ([(-1, "started", None)], 61, ("silent", None)),
        ([], 5, ("running", None)),  # telemetry only (a replayed trace): running while heard
        ([(-1, "started", None), (1, "failed", 3), (0, "running", None)], 1, ("failed", 3)),
        ([(-1, "killed", 137)], 1, ("killed", 137)),  # stopped by a signal: not a failure
        ([(-1, "killed", 130), (1, "failed", 1)], 1, ("failed", 1)),  # a rank's failure first
        ([(-1, "finished", 0), (0, "finished", 0)], 500, ("finished", 0)),
        ([(0, "finished", 0), (1, "finished", 0)], 500, ("finished", 0)),  # no wrapper
        ([(0, "finished", 0), (1, "running", None)], 500, ("silent", None)),  # one rank left
    ],
)
def test_a_jobs_state_from_its_lifecycle_and_last_telemetry(
    lifecycle: list[tuple[int, str, int | None]],
    seen_s_ago: int,
    expected: tuple[str, int | None],
) -> None:
    assert job_state(lifecycle, NOW - seen_s_ago * NS, NOW) == expected


def test_durations() -> None:
    assert parse_duration("1d") == 86400
    assert parse_duration("30m") == 1800
    assert parse_duration(" 2 h ") == 7200
    assert parse_duration("1w") == 7 * 86400
    for bad in ("", "1", "d", "-1d", "0s", "1y", "1dd"):
        with pytest.raises(ValueError, match="s, m, h, d, w"):
            parse_duration(bad)


def test_ranks_as_ranges() -> None:
    assert ranks_text([5]) == "5"
    assert ranks_text([0, 1, 2, 3, 8, 9, 12]) == "0-3,8-9,12"


def _rows() -> list:  # type: ignore[type-arg]
    starve = DiagnosisSummary("dataloader_starvation", "host", (0, 1, 2, 3), 0.42, True)
    context = DiagnosisSummary("compute_bound", "kernel", (), 0.9, False)
    change = ChangeSummary("dataloader.num_workers", "0", "4", "kept", NOW - 30 * NS)
    return build_rows(
        seen={
            "run-20261206-old": (NOW - 7200 * NS, NOW - 3600 * NS),
            "train-llama-70b": (NOW - 600 * NS, NOW - 1 * NS),
            "replayed": (NOW - 50 * NS, NOW - 40 * NS),
        },
        lifecycle={
            "run-20261206-old": [(-1, "finished", 0, NOW - 7300 * NS)],
            "train-llama-70b": [(-1, "started", None, NOW - 660 * NS)],
        },
        info={"train-llama-70b": (64, 8)},
        steps={
            "train-llama-70b": (812.5, 1.23, 60, 8),
            "replayed": (31.0, None, 2, 1),
        },
        diagnoses={"train-llama-70b": [context, starve]},
        changes={"train-llama-70b": change},
        now_ns=NOW,
    )


def test_rows_join_each_querys_answer() -> None:
    rows = _rows()
    # running jobs first, the most recently seen first; then the ended ones
    assert [r.job_id for r in rows] == ["train-llama-70b", "replayed", "run-20261206-old"]
    llama, replayed, old = rows
    assert (llama.state, llama.ranks, llama.nodes) == ("running", 64, 8)  # JobInfo's world
    assert (llama.step_time_ms, llama.steps_per_s) == (812.5, 1.23)
    assert llama.started_ns == NOW - 660 * NS  # its lifecycle began before its telemetry
    # the critical-path bottleneck first, then the context
    assert [d.bottleneck for d in llama.diagnoses] == ["dataloader_starvation", "compute_bound"]
    assert llama.last_change is not None and llama.last_change.verdict == "kept"
    assert (replayed.state, replayed.ranks, replayed.nodes) == ("running", 2, 1)  # from steps
    assert (old.state, old.exit_code, old.ranks, old.step_time_ms) == ("finished", 0, None, None)


def test_the_table_for_people_fits_120_characters() -> None:
    text = render_table(_rows(), NOW, width=120)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 120
    header = lines[0].split()
    assert header[:6] == ["JOB", "STATE", "RANKS", "NODES", "STEP", "ms"]
    llama = next(line for line in lines if line.startswith("train-llama-70b"))
    assert "running" in llama and "812.5" in llama and "1.23" in llama
    # a cell too wide for its column wraps at a space, under itself
    diag = llama.index("dataloader_starvation")
    assert lines[lines.index(llama) + 1][diag:].startswith("r0-3 42%")
    assert "compute_bound all 90%" in text
    change = llama.index("dataloader.num_workers")
    assert lines[lines.index(llama) + 1][change:].startswith("0→4 kept")
    assert llama.split()[-2:] == ["11m", "1s"]  # age (since it started), last seen
    old = next(line for line in lines if line.startswith("run-20261206-old"))
    assert "finished" in old and old.split()[-2:] == ["2h", "1h"]
    assert lines[-1] == "AGE: since it started; SEEN: how long ago"
    # narrower: the wrapping columns give way, then the job ids fold; nothing passes the width
    for width in (100, 80):
        assert max(len(x) for x in render_table(_rows(), NOW, width=width).splitlines()) <= width


def test_the_json_for_scripts() -> None:
    docs = json.loads(json.dumps(to_json(_rows())))
    llama = docs[0]
    assert llama["job_id"] == "train-llama-70b"
    assert (llama["state"], llama["ranks"], llama["nodes"]) == ("running", 64, 8)
    assert llama["diagnoses"][0] == {
        "bottleneck": "dataloader_starvation",
        "level": "host",
        "ranks": [0, 1, 2, 3],
        "step_share": 0.42,
        "critical_path": True,
        "explained_by": "",
        "diagnosis_id": "",
        "summary": "",
    }
    assert llama["last_change"]["verdict"] == "kept"
    assert llama["last_seen_ns"] == NOW - NS
    assert llama["last_seen"].endswith("Z")
    assert docs[2]["step_time_ms"] is None and docs[2]["last_change"] is None


def test_options() -> None:
    args = build_parser().parse_args(["jobs", "--since", "12h", "--json"])
    assert (args.since, args.all, args.json) == (43200.0, False, True)
    assert build_parser().parse_args(["jobs"]).since == 86400.0
    assert build_parser().parse_args(["top", "--job", "j1"]).job == "j1"


def test_a_bad_since_is_a_command_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["jobs", "--since", "yesterday"])
    assert e.value.code == 2
    assert "invalid duration 'yesterday'" in one_line(capsys.readouterr().err)


def test_without_a_warehouse_one_line_and_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PERFLOOP_CLICKHOUSE_URL", f"http://127.0.0.1:{closed_port()}")
    assert main(["jobs", "--json"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert "unreachable" in one_line(err)


def test_top_needs_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["top"]) == 1  # pytest's stdin and stdout are no terminal
    assert "needs a terminal" in one_line(capsys.readouterr().err)
