"""``perfloop report JOB [-o FILE.html] [--flops-per-step N]``: one self-contained HTML page
about a job (its plots and accounting, `perfloop.report`), written to FILE.html
(``perfloop-report-<job>.html`` in the current directory by default), and one line of its
headline figures on stdout. An unknown job, an unreachable warehouse or a file that cannot be
written is one line on stderr and exit 1."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from perfloop.exceptions import ConfigError
from perfloop.settings import load_settings

__all__ = ["default_output", "positive_float", "report_command"]


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (``1.2e12`` accepted)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def default_output(job: str) -> Path:
    """``perfloop-report-<job>.html`` in the current directory, the job id's characters that do
    not belong in a file name (``/``, ``:``, ``@``) replaced by ``_``.

    >>> default_output("team/run:7").name
    'perfloop-report-team_run_7.html'
    """
    return Path(f"perfloop-report-{re.sub(r'[^A-Za-z0-9._+-]', '_', job)}.html")


def report_command(args: argparse.Namespace) -> int:
    from perfloop.report import make_report
    from perfloop.settings import ReportSettings

    settings = load_settings(ReportSettings)
    out = Path(args.output) if args.output else default_output(args.job)
    report = make_report(settings, args.job, flops_per_step=args.flops_per_step)
    try:
        out.write_text(report.html, encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot write the report to {out}: {e.strerror or e}") from e
    s = report.summary
    t = s.time
    print(
        f"wrote {out}: {t.wall_ns / 1e9:,.1f} s of {t.ranks} rank(s), "
        f"goodput {s.figure('goodput').text()}, MFU {s.figure('MFU').text()}, "
        f"cost {s.figure('cost').text()}"
    )
    return 0
