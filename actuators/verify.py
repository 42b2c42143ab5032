"""Moved: judging a change is `perfloop.actuators.verification` (this module's name was also
the package's signature check, `perfloop.actuators.verify`, which stays). These names warn and
keep working for one release."""

from perfloop.deprecation import callable_as, moved

__all__: list[str] = []

__getattr__ = moved(
    __name__,
    {
        n: "perfloop.actuators.verification"
        for n in ("MIN_BASELINE", "ChangeVerifier", "Verdict", "mann_whitney_p")
    },
)

# Importing this module makes the package's ``verify`` this module: it calls through to the
# function, so every caller of the package's ``verify`` still gets the function's answer.
callable_as(__name__, "perfloop.actuators.signing", "verify")
