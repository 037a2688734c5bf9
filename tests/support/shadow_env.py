"""The environment of a test run that keeps shadow validation on (tests/conftest.py turns it off)."""

import os


def shadow_on() -> dict[str, str]:
    """This process's environment without the suite's shadow switch: the run's own config decides."""
    return {name: value for name, value in os.environ.items() if name != "SAO__TRAINER__SHADOW_EVERY"}
