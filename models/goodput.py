"""Moved: goodput and batch size are `perfloop.models.batch_size` (this module's name was also
the package's function, `perfloop.models.goodput`, which stays). These names warn and keep
working for one release."""

from perfloop.deprecation import callable_as, moved

__all__: list[str] = []

__getattr__ = moved(
    __name__,
    {
        n: "perfloop.models.batch_size"
        for n in (
            "BatchSizeRecommendation",
            "GradientNoiseScale",
            "StepTimeModel",
            "goodput",
            "recommend_batch_size",
            "statistical_efficiency",
        )
    },
)

# Importing this module makes the package's ``goodput`` this module: it calls through to the
# function, so every caller of the package's ``goodput`` still gets the function's answer.
callable_as(__name__, "perfloop.models.batch_size", "goodput")
