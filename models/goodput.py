"""Moved: goodput and batch size are `perfloop.models.batch_size` (this module's name was also
the package's function, `perfloop.models.goodput`, which stays). These names warn and keep
working for one release."""

from perfloop.deprecation import moved

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
