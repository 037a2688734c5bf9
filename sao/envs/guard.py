"""Call environment code (built-in or a user's plugin) so that its failures end one episode only.

An env that raises, or runs past `env.turn_timeout_s`, turns into `EnvFailure` with a DLQ
reason (env-error or env-timeout; invalid-task for a spec the env refused as `InvalidTask`);
the sampler dead-letters the task and goes on. The time limit uses SIGALRM, so it interrupts
Python code in the sampler's main thread; code that runs untrusted programs (e.g. unit tests of
generated code) must still use its own subprocess limits.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import TypeVar

from sao.dead_letters import DeadLetterReason
from sao.envs.base import InvalidTask

T = TypeVar("T")


class EnvFailure(RuntimeError):
    def __init__(self, reason: DeadLetterReason, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class _Timeout(BaseException):
    """BaseException so that an env's own `except Exception` cannot swallow the time limit."""


@contextmanager
def _time_limit(seconds: float):
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(*_):
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def call_env(what: str, function: Callable[..., T], *args, timeout_s: float) -> T:
    """Run `function(*args)`; any exception or overrun becomes EnvFailure naming `what`."""
    try:
        with _time_limit(timeout_s):
            return function(*args)
    except InvalidTask as err:
        raise EnvFailure(DeadLetterReason.INVALID_TASK, f"{what}: {err}") from err
    except _Timeout:
        raise EnvFailure(DeadLetterReason.ENV_TIMEOUT,
                         f"{what} ran longer than env.turn_timeout_s={timeout_s:g} s") from None
    except Exception as err:  # the env is user code: any failure of it ends this episode only
        raise EnvFailure(DeadLetterReason.ENV_ERROR, f"{what} raised {type(err).__name__}: {err}") from err
