"""Stdlib-only half of HumanEval grading, run on both sides: the plain-data codec and the problem's check().

The sandboxed programs of `sao.envs.humaneval_grading` are this file's source plus one call:
`record_calls` (the canonical solution under the problem's own check(), recording each call's
arguments and result) or `run_calls` (a reply's function on those arguments). The sao process
imports it to decode the results and to run check() again with a proxy that returns them, so the
verdict comes from code and data the reply cannot touch. Keep it free of sao imports, and of
heavy ones at the top (`json` pulls in `re`, a measurable part of every sandboxed run): `_json`'s string
escaping is all the sandbox needs.

Plain data: None, bool, int, float, str, and lists, tuples and dicts of plain data, by exact type
(anything else, e.g. an object whose `__eq__` always holds, or a subclass of int, is refused).
On the wire it is JSON; tuples and dicts are tagged objects, so `(1, 2)` stays apart from
`[1, 2]` and dict keys keep their types. HumanEval's arguments and results are all plain data.
"""

from __future__ import annotations

import builtins
import sys
from _json import encode_basestring_ascii

RANDOM_SEED = 20240101  # checks that draw random inputs (HumanEval/38, 50, 53) draw the same ones on every run
REPLY_FILE = "<reply>"  # the reply's code, as tracebacks name it
TESTS_FILE = "<tests>"  # the problem's prompt and tests, as tracebacks name them
ERROR_CHARS = 300
PLAIN_TYPES = "None, bool, int, float, str, list, tuple, dict"
_FLOATS = {"inf": "Infinity", "-inf": "-Infinity", "nan": "NaN"}  # as Python's json writes and reads them
nan, inf = float("nan"), float("inf")  # so that repr() of plain data, as `run_calls` receives it, evaluates here


class NotPlainData(TypeError):
    """A value outside plain data: the reply's function returned something else."""


def dump(value) -> str:
    """Plain data as JSON text; NotPlainData for anything else (ValueError for an int too long to
    write, RecursionError for nesting too deep)."""
    kind = type(value)
    if value is None:
        return "null"
    if kind is bool:
        return "true" if value else "false"
    if kind is int:
        return int.__repr__(value)
    if kind is float:
        text = float.__repr__(value)
        return _FLOATS.get(text, text)
    if kind is str:
        return encode_basestring_ascii(value)
    if kind is list:
        return "[" + ",".join(map(dump, value)) + "]"
    if kind is tuple:
        return '{"tuple":[' + ",".join(map(dump, value)) + "]}"
    if kind is dict:
        return '{"dict":[' + ",".join(f"[{dump(key)},{dump(item)}]" for key, item in value.items()) + "]}"
    raise NotPlainData(f"non-builtin return type {kind.__module__}.{kind.__qualname__} (plain data only: {PLAIN_TYPES})")


def decode(data):
    """Plain data from `dump`'s JSON, parsed; TypeError, ValueError or KeyError on anything else."""
    if isinstance(data, list):
        return [decode(item) for item in data]
    if not isinstance(data, dict):
        return data
    ((tag, items),) = data.items()
    if not isinstance(items, list):
        raise TypeError(f"tagged {tag!r} holds {type(items).__name__}, not a list")
    if tag == "tuple":
        return tuple(decode(item) for item in items)
    if tag == "dict":
        return {decode(key): decode(item) for key, item in items}
    raise ValueError(f"unknown tag {tag!r}")


def call_key(args: tuple, kwargs: dict) -> str:
    """The arguments of one call as a string: the same on every run, the lookup key of its result."""
    return dump([list(args), kwargs])


def describe(error: BaseException, source: str, filename: str = REPLY_FILE) -> str:
    """`Type: message`, then the last line of `source` (compiled as `filename`) the traceback passed through."""
    text = type(error).__name__
    try:
        message = str(error)
    except Exception:  # noqa: BLE001 - a hostile __str__ must not stop the report
        message = ""
    text += f": {message}" if message else ""
    line_number, trace = None, error.__traceback__
    while trace is not None:
        if trace.tb_frame.f_code.co_filename == filename:
            line_number = trace.tb_lineno
        trace = trace.tb_next
    lines = source.splitlines()
    if line_number is not None and 0 < line_number <= len(lines):
        text += f" (line {line_number}: {lines[line_number - 1].strip()})"
    return text[:ERROR_CHARS]


def _check_random():
    """Stands in for the `random` module inside check(): its functions, seeded, and its classes.
    A private generator: the reply's or the sao process's own use of `random` shifts nothing."""
    import random  # not at the top: the sandboxed run of a reply never needs it

    class CheckRandom(random.Random):
        Random, SystemRandom = random.Random, random.SystemRandom

    return CheckRandom(RANDOM_SEED)


def run_check(tests, entry_point: str, candidate) -> None:
    """Run the problem's check(candidate); `tests` is `prompt + test`, compiled. Raises what
    check() raises (AssertionError when a test fails)."""
    check_random = _check_random()

    def import_(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "random" and level == 0:
            return check_random
        return builtins.__import__(name, globals, locals, fromlist, level)

    namespace = {"__builtins__": {**vars(builtins), "__import__": import_}, "__name__": "humaneval_tests"}
    exec(tests, namespace)
    namespace[entry_point] = candidate  # as in the original harness, where the reply's def came last
    namespace["check"](candidate)


def record_calls(prompt: str, solution: str, test: str, entry_point: str) -> None:
    """In the sandbox: run check() on the canonical solution; print a JSON list of each distinct
    call's [args, kwargs, result], in the order check() made them."""
    namespace = {"__name__": "solution"}
    exec(compile(prompt + solution, REPLY_FILE, "exec"), namespace)
    function = namespace[entry_point]
    calls: dict[str, str] = {}

    def recording(*args, **kwargs):
        arguments = call_key(args, kwargs)  # before the call, which may change them
        result = function(*args, **kwargs)
        calls.setdefault(arguments, f"{arguments[:-1]},{dump(result)}]")
        return result

    run_check(compile(prompt + "\n" + test, TESTS_FILE, "exec"), entry_point, recording)
    sys.stdout.write("[" + ",".join(calls.values()) + "]")


def run_calls(source: str, entry_point: str, calls: list) -> None:
    """In the sandbox: define the reply's function, call it on each (args, kwargs) of `calls`, and
    write one JSON line per call: {"value": plain data} | {"error": why it raised} | {"refused":
    why the value is not plain data}. A reply that does not load gets one line {"load_error": why}.
    The reply's own output goes to stderr, even what it writes to fd 1 itself."""
    import os

    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def emit(key: str, text: str) -> None:
        results.write(f'{{"{key}":{text}}}\n')
        results.flush()  # a run cut short by a limit still tells how far it got

    namespace = {"__name__": "solution"}  # not __main__: a reply's own demo block does not run
    try:
        exec(compile(source, REPLY_FILE, "exec"), namespace)
        function = namespace[entry_point]
    except BaseException as error:  # noqa: BLE001 - SystemExit too: the reply's failure, reported
        emit("load_error", dump(describe(error, source)))
        return
    for args, kwargs in calls:
        try:
            value = function(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - any way the call ends is a result
            emit("error", dump(describe(error, source)))
            continue
        try:
            emit("value", dump(value))
        except NotPlainData as error:
            emit("refused", dump(str(error)))
        except (ValueError, RecursionError) as error:  # an int too long to write, nesting too deep
            emit("refused", dump(f"value that cannot be sent back ({str(error)[:ERROR_CHARS]})"))
