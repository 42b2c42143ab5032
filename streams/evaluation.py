"""Moved: the funnel's offline evaluation on simulated jobs is `perfloop.evaluation` (it runs
the simulator, which the stream tier does not import). These names warn and keep working for
one release."""

from perfloop.deprecation import moved

__all__: list[str] = []

__getattr__ = moved(
    __name__,
    {
        n: "perfloop.evaluation"
        for n in (
            "REPORT_SEEDS",
            "SCENARIOS",
            "SHAPES",
            "TUNE_SEEDS",
            "KindScore",
            "RunResult",
            "RunSpec",
            "evaluate",
            "format_table",
            "replay",
            "run_scenario",
            "score",
            "simulate",
        )
    },
)
