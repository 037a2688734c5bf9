"""Grade a HumanEval reply: its function runs in the sandbox and hands back data; the sao process decides.

Once per problem and process, the canonical solution runs under the problem's own check() in
the sandbox, recording each distinct call: arguments and result. For each reply, the sandbox
calls the reply's function on those arguments and returns the results as plain data (see
`humaneval_harness`). The problem's check() then runs here, in the sao process, with a proxy
candidate that answers each call from those results: the asserts, their tolerances and any
property checks are the original ones, but nothing the reply does in its process (print the
sentinel of the old design and exit, return an object whose `==` always holds) reaches them.
The verdict never depends on the sandboxed process's exit status either, only on its data.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from types import CodeType
from typing import Any

from sao.config import SandboxConfig
from sao.envs import humaneval_harness as harness
from sao.envs.sandbox import SandboxError, SandboxResult, run_python

log = logging.getLogger(__name__)

HARNESS_SOURCE = Path(harness.__file__).read_text()
RESULTS_CHARS = 1 << 20  # of the results' JSON: the largest recording is 6 kB; decoding more is the sampler's memory
VALUE_CHARS = 120  # of one argument list or value quoted back to the policy
DETAIL_CHARS = 480  # of the whole message
_recordings: dict[str, Recording] = {}
_recording_lock = threading.Lock()


@dataclass(frozen=True)
class Recording:
    """What the canonical solution did under check(): the calls to replay and their right results."""

    tests_file: str  # the name tracebacks give the prompt + tests
    tests_source: str
    tests: CodeType
    calls_literal: str  # [(args, kwargs), ...] as a Python literal, in check()'s order
    keys: tuple[str, ...]  # harness.call_key of each call, same order
    expected: dict[str, Any]  # call key -> the canonical result


@dataclass(frozen=True)
class Grade:
    """How one reply did: `status` is passed | failed | timeout | memory | killed | exited-early."""

    status: str
    detail: str  # what went wrong, for the policy ("" when passed)
    wall_s: float  # the sandbox run


class _ReplyFailed(Exception):
    """A replayed call whose recorded outcome is a failure (an exception, a refused value)."""


class _UnrecordedCall(Exception):
    """check() made a call the recording run did not: the tests depend on something we do not replay."""


def recording(problem_id: str, problem: dict[str, str], limits: SandboxConfig) -> Recording:
    """The problem's recorded calls, made once per process (one sandbox run)."""
    with _recording_lock:
        if problem_id not in _recordings:
            _recordings[problem_id] = _record(problem_id, problem, limits)
        return _recordings[problem_id]


def _record(problem_id: str, problem: dict[str, str], limits: SandboxConfig) -> Recording:
    arguments = ", ".join(repr(problem[key]) for key in ("prompt", "canonical_solution", "test", "entry_point"))
    result = run_python(f"{HARNESS_SOURCE}\nrecord_calls({arguments})\n", limits, stdout_chars=RESULTS_CHARS)
    try:
        calls = [[harness.decode(part) for part in call] for call in json.loads(result.stdout_tail)]
    except (ValueError, TypeError, KeyError):
        calls = []
    if result.status != "passed" or not calls:
        raise SandboxError(f"the canonical solution of {problem_id} did not pass its own tests in the sandbox "
                           f"({result.status}; check env.sandbox limits): {result.stderr_tail[-500:]}")
    tests_file = f"<tests of {problem_id}>"
    tests_source = problem["prompt"] + "\n" + problem["test"]
    keys = tuple(harness.call_key(args, kwargs) for args, kwargs, _ in calls)
    return Recording(tests_file, tests_source, compile(tests_source, tests_file, "exec"),
                     repr([(args, kwargs) for args, kwargs, _ in calls]), keys,
                     {key: expected for key, (_, _, expected) in zip(keys, calls)})


def grade(problem_id: str, problem: dict[str, str], solution: str, limits: SandboxConfig) -> Grade:
    """Run `solution` (the prompt and the reply's code) on the recorded calls; check() decides."""
    recorded = recording(problem_id, problem, limits)
    entry_point = problem["entry_point"]
    program = f"{HARNESS_SOURCE}\nrun_calls({solution!r}, {entry_point!r}, {recorded.calls_literal})\n"
    result = run_python(program, limits, stdout_chars=RESULTS_CHARS)
    status, detail = _verdict(recorded, entry_point, result, limits)
    return Grade(status, _short(detail, DETAIL_CHARS), result.wall_s)


def _outcomes(stdout: str) -> list[dict]:
    """The per-call lines, up to the first that is not one (a run cut short mid-line)."""
    outcomes = []
    for line in stdout.splitlines():
        try:
            outcome = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than this process's stack allows
            break
        if not isinstance(outcome, dict):
            break
        outcomes.append(outcome)
    return outcomes


def _verdict(recorded: Recording, entry_point: str, result: SandboxResult, limits: SandboxConfig) -> tuple[str, str]:
    if len(result.stdout_tail) >= RESULTS_CHARS:  # only its tail came back
        return "failed", f"Your function's results are too large (over {RESULTS_CHARS >> 20} MiB as JSON in all)."
    outcomes = _outcomes(result.stdout_tail)
    if outcomes and "load_error" in outcomes[0]:
        return "failed", f"Your code does not run: {outcomes[0]['load_error']}"
    if len(outcomes) < len(recorded.keys):  # the process ended before its function ran on every input
        return _cut_short(result, limits, _call_text(entry_point, recorded.keys[len(outcomes)]))
    replay = _Replay(entry_point, dict(zip(recorded.keys, outcomes)))
    try:
        harness.run_check(recorded.tests, entry_point, replay)
    except _ReplyFailed as failure:
        return "failed", f"Your code failed a test: {replay.last_call} {failure}."
    except _UnrecordedCall as unrecorded:
        log.warning("the tests of %s called %s, which the recording run did not", recorded.tests_file, unrecorded)
        return "failed", f"Your code failed a test: the call {unrecorded} was not expected."
    except Exception as error:  # noqa: BLE001 - an assert, or the tests choking on the values returned
        wanted = ""
        if replay.last_key in recorded.expected:
            wanted = f"; expected {_short(repr(recorded.expected[replay.last_key]))}"
        return "failed", (f"Your code failed a test: {replay.last_call} returned "
                          f"{_short(_repr(replay.last_value))}{wanted}.\n"
                          f"The test: {harness.describe(error, recorded.tests_source, recorded.tests_file)}")
    return "passed", ""


def _cut_short(result: SandboxResult, limits: SandboxConfig, pending: str) -> tuple[str, str]:
    if result.status == "timeout":
        return "timeout", (f"Your code ran too long (limits: {limits.cpu_time_s:g} s CPU, "
                           f"{limits.wall_time_s:g} s wall clock), at {pending}.")
    if result.status == "memory":
        return "memory", (f"Your code ran out of memory (limits: {limits.memory_mb} MiB per process, "
                          f"{limits.total_memory_mb} MiB in all), at {pending}.")
    if result.status == "killed":
        return "killed", f"Your code crashed (signal {-(result.returncode or 0)}) at {pending}."
    return "exited-early", f"Your code exited before the tests ran (at {pending})."


class _Replay:
    """The candidate check() calls here: each call answered from the reply's recorded outcome."""

    def __init__(self, entry_point: str, outcomes: dict[str, dict]):
        self.entry_point, self.outcomes = entry_point, outcomes
        self.last_key, self.last_call, self.last_value = "", "", None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.last_key = harness.call_key(args, kwargs)
        self.last_call = _call_text(self.entry_point, self.last_key)
        outcome = self.outcomes.get(self.last_key)
        if outcome is None:
            raise _UnrecordedCall(self.last_call)
        if "error" in outcome:
            raise _ReplyFailed(f"raised {outcome['error']}")
        if "refused" in outcome:
            raise _ReplyFailed(f"gave a {outcome['refused']}")
        try:
            self.last_value = harness.decode(outcome["value"])  # a fresh copy at each call
        except (KeyError, TypeError, ValueError, RecursionError) as error:
            raise _ReplyFailed(f"returned something that is not plain data ({error})") from None
        return self.last_value


def _call_text(entry_point: str, key: str) -> str:
    """`f(1, [2, 3], x=4)` from a call key, shortened."""
    args, kwargs = harness.decode(json.loads(key))
    shown = [repr(arg) for arg in args] + [f"{name}={value!r}" for name, value in kwargs.items()]
    return f"{entry_point}({_short(', '.join(shown))})"


def _repr(value: Any) -> str:
    try:
        return repr(value)
    except RecursionError:
        return f"a {type(value).__name__} nested too deep to show"


def _short(text: str, chars: int = VALUE_CHARS) -> str:
    return text if len(text) <= chars else text[:chars - 3] + "..."
