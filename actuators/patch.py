"""Moved: the slow loop's config patch is `perfloop.actuators.config_patch`. These names warn
and keep working for one release."""

from perfloop.deprecation import moved

__all__: list[str] = []

__getattr__ = moved(
    __name__,
    {n: "perfloop.actuators.config_patch" for n in ("ConfigPatch", "patch_path", "read_patch")},
)
