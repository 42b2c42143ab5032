"""Moved: the node sampler is `perfloop.producers.node_sampler`; ``perfloop sample``'s body is
`perfloop.cli.sample`. These names warn and keep working for one release."""

from perfloop.deprecation import moved

__all__: list[str] = []

__getattr__ = moved(
    __name__,
    {
        **{
            n: "perfloop.producers.node_sampler"
            for n in ("CONTROL_WINDOW_S", "GPU_TOLERANCES", "NodeSampler", "config_listener")
        },
        "sample_command": "perfloop.cli.sample",
    },
)
