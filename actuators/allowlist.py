"""Moved: the knob allow-list is `perfloop.schemas.knobs` (the contract between the actuator
and the jobs it commands). These names warn and keep working for one release."""

from perfloop.deprecation import moved

__all__: list[str] = []

__getattr__ = moved(
    __name__,
    {
        n: "perfloop.schemas.knobs"
        for n in (
            "ACTION_KNOBS",
            "BOOL_KNOBS",
            "HOOK_KNOBS",
            "HOST_NAME",
            "INT_KNOBS",
            "KNOB_BOUNDS",
            "PINNABLE_KNOBS",
            "SPEED_KNOBS",
            "knob_problem",
            "pinned_knobs",
        )
    },
)
