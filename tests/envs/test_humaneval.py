"""The HumanEval env: splits, code extraction, grading out of the reply's reach, multi-turn feedback."""

from __future__ import annotations

import json
import math
import os
import textwrap
import time

import psutil
import pytest

from sao.config import EnvConfig, SandboxConfig
from sao.envs import humaneval_grading
from sao.envs import humaneval_harness as harness
from sao.envs.guard import EnvFailure, call_env
from sao.envs.humaneval import HumanEvalEnv, extract_code, problems, split_problems
from sao.envs.humaneval_harness import NotPlainData, decode, dump
from sao.envs.registry import env_class, make_env, make_tasks
from sao.envs.sandbox_launch import UID_BASE
from sao.policy.sampling import StopRule

FAST = SandboxConfig(cpu_time_s=1, wall_time_s=2, memory_mb=256, max_processes=8, max_file_mb=2)
CONFIG = EnvConfig(name="humaneval", max_turns=2, retry_discount=0.5, sandbox=FAST)


def fenced(code: str) -> str:
    return f"Here is the function:\n```python\n{code}\n```\nIt works."


def started(problem_id: str, config: EnvConfig = CONFIG) -> tuple[HumanEvalEnv, dict]:
    env = make_env(config)
    env.reset({"problem": problem_id})
    return env, problems()[problem_id]


def test_registry_finds_the_env():
    assert env_class("humaneval") is HumanEvalEnv
    assert "```python" in HumanEvalEnv.generation_defaults.system_prompt


def test_splits_are_disjoint_and_cover_all_problems():
    train, held_out = split_problems("train"), split_problems("eval")
    assert (len(problems()), len(train), len(held_out)) == (164, 131, 33)
    assert not set(train) & set(held_out) and set(train) | set(held_out) == set(problems())
    with pytest.raises(ValueError, match="splits"):
        split_problems("test")


def test_tasks_cycle_the_split_with_unique_ids():
    tasks = make_tasks(CONFIG, 140)
    assert len({task.task_id for task in tasks}) == 140
    assert tasks[131].spec == tasks[0].spec and tasks[1].spec != tasks[0].spec  # wrapped around in order
    later = make_tasks(CONFIG, 3, start_index=5)
    assert [(t.task_id, t.spec) for t in later] == [(t.task_id, t.spec) for t in tasks[5:8]]
    held_out = make_tasks(CONFIG, 33, split="eval")
    assert {task.spec["problem"] for task in held_out} == set(split_problems("eval"))
    assert all(task.task_id.startswith("eval/humaneval/") for task in held_out)


@pytest.mark.parametrize("reply, code", [
    ("```python\nx = 1\n```\ntext\n```python\nx = 2\n```", "x = 2"),  # the last block
    ("Sure:\n```\nreturn 3\n```", "return 3"),  # a bare fence
    ("```python\ndef f():\n    return 1", "def f():\n    return 1"),  # cut off by max_new_tokens
    ("def f():\n    return 1\n", "def f():\n    return 1\n"),  # unfenced, but Python
    ("I am not sure how to do this.", None),
    ("```text\nnot code\n```", None),
    ("```python\n\n```", None),
])
def test_extract_code(reply, code):
    assert extract_code(reply) == code


def test_a_reply_ends_after_its_code_block():
    """The env's stop string ends a reply at its block: no tokens spent on what follows, and a usage example
    after it is not what runs."""
    stop = StopRule(frozenset(), HumanEvalEnv.generation_defaults.stop, decode=lambda ids: "".join(map(chr, ids)))
    reply = "```python\ndef add(a, b):\n    return a + b\n```\n\nExample:\n```python\nprint(add(1, 2))\n```\n"
    ends = next(n for n in range(1, len(reply) + 1) if stop.ends([ord(c) for c in reply[:n]]))
    assert reply[:ends].endswith("return a + b\n```\n\n")
    assert extract_code(stop.cut(reply)) == "def add(a, b):\n    return a + b"
    assert extract_code(reply) == "print(add(1, 2))"  # without the stop, the example would run
    for opening in ("```python\n\ndef f():", "Sure:\n```\ndef f():"):  # an opening fence goes on
        assert not any(stop.ends([ord(c) for c in opening[:n]]) for n in range(1, len(opening) + 1)), opening


def test_prompt_shows_the_signature_and_docstring():
    env = make_env(CONFIG)
    prompt = env.reset({"problem": "HumanEval/0"})
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in prompt
    assert "complete function" in prompt


@pytest.mark.parametrize("problem_id", ["HumanEval/0", "HumanEval/10", "HumanEval/38"])  # 10, 38 have helpers
def test_canonical_solution_passes_as_function_and_as_body(problem_id):
    env, problem = started(problem_id)
    as_function = env.step(fenced(problem["prompt"] + problem["canonical_solution"]))
    assert (as_function.reward, as_function.done, as_function.info["status"]) == (1.0, True, "passed")
    env.reset({"problem": problem_id})
    as_body = env.step(fenced(problem["canonical_solution"]))
    assert (as_body.reward, as_body.done) == (1.0, True)


def test_wrong_answer_gets_the_failing_input_then_a_discounted_reward():
    env, problem = started("HumanEval/0")
    wrong = env.step(fenced("def has_close_elements(numbers, threshold):\n    return True"))
    assert not wrong.done and wrong.reward == 0
    assert (wrong.info["status"], wrong.info["attempt"]) == ("failed", 0)
    assert "has_close_elements([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) returned True; expected False" in wrong.observation
    assert "assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) == False" in wrong.observation  # the test
    assert len(wrong.observation) < 600
    right = env.step(fenced(problem["prompt"] + problem["canonical_solution"]))
    assert right.done and right.reward == pytest.approx(CONFIG.retry_discount) and right.info["attempt"] == 1


def test_no_code_is_an_attempt_and_the_last_turn_ends_with_nothing():
    env, _ = started("HumanEval/2")
    first = env.step("I would rather not write code.")
    assert not first.done and first.info["status"] == "no-code" and "no Python code" in first.observation
    last = env.step(fenced("def truncate_number(number):\n    return 0.0"))
    assert last.done and last.reward == 0 and last.info["status"] == "failed"


@pytest.mark.parametrize("body, status", [("import os\nos._exit(0)", "exited-early"), ("import sys\nsys.exit(0)", "failed")])
def test_exiting_before_the_tests_does_not_pass(body, status):
    env, _ = started("HumanEval/2")
    feedback = env.step(fenced(body))
    assert feedback.reward == 0 and feedback.info["status"] == status


SENTINEL_HACK = """
import os, re, sys, __main__
source = open(getattr(__main__, "__file__", None) or sys.argv[0]).read()
for token in set(re.findall(r"sao-tests-done-[0-9a-f]+", source)):
    print(token)  # the old harness printed this random token after check() to prove the tests ran
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.parametrize("where", ["module", "function"])
def test_printing_the_sentinel_of_its_own_file_and_exiting_does_not_pass(where):
    env, _ = started("HumanEval/0")
    if where == "module":
        code = SENTINEL_HACK + "\ndef has_close_elements(numbers, threshold):\n    return True\n"
    else:
        code = "def has_close_elements(numbers, threshold):\n" + textwrap.indent(SENTINEL_HACK, "    ")
    feedback = env.step(fenced(code))
    assert feedback.reward == 0 and feedback.info["status"] == "exited-early"


@pytest.mark.parametrize("returned", [
    "class AlwaysEqual:\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n"
    "        return False\n    __hash__ = object.__hash__\nANSWER = AlwaysEqual()",
    "class Sneaky(int):\n    def __eq__(self, other):\n        return True\nANSWER = Sneaky(0)",  # a builtin's subclass
    "ANSWER = [True, iter([])]",  # nested
])
def test_a_value_that_is_not_plain_data_does_not_pass(returned):
    env, _ = started("HumanEval/0")
    feedback = env.step(fenced(f"{returned}\n\ndef has_close_elements(numbers, threshold):\n    return ANSWER\n"))
    assert feedback.reward == 0 and feedback.info["status"] == "failed"
    assert "non-builtin return type" in feedback.observation


@pytest.mark.parametrize("value, reason", [("10 ** 5000", "value that cannot be sent back"),
                                           ("nested", "value that cannot be sent back"),
                                           ("'x' * (3 << 20)", "results are too large")])
def test_a_value_too_big_to_send_back_is_a_failed_attempt(value, reason):
    env, _ = started("HumanEval/0")
    make = "value = []\n    for _ in range(10**5):\n        value = [value]" if value == "nested" else f"value = {value}"
    feedback = env.step(fenced(f"def has_close_elements(numbers, threshold):\n    {make}\n    return value"))
    assert feedback.info["status"] == "failed" and reason in feedback.observation


def test_the_original_asserts_decide_with_their_own_tolerance():
    env, _ = started("HumanEval/4")  # assert abs(candidate(...) - expected) < 1e-6
    close = "def mean_absolute_deviation(numbers):\n    m = sum(numbers) / len(numbers)\n" \
            "    return sum(abs(x - m) for x in numbers) / len(numbers) + {error}"
    assert env.step(fenced(close.format(error="1e-9"))).reward == 1.0
    env.reset({"problem": "HumanEval/4"})
    assert env.step(fenced(close.format(error="1e-3"))).reward == 0


def test_a_replys_prints_and_demo_block_do_not_disturb_the_results():
    env, problem = started("HumanEval/0")
    chatty = (problem["prompt"] + "    print('checking', numbers)\n" + problem["canonical_solution"]
              + "\nprint('loaded')\nif __name__ == '__main__':\n    print(has_close_elements([1.0], input()))\n")
    feedback = env.step(fenced(chatty))
    assert feedback.reward == 1.0, feedback.observation


def test_an_exception_names_the_input_and_the_line():
    env, _ = started("HumanEval/0")
    feedback = env.step(fenced("def has_close_elements(numbers, threshold):\n    return numbers[10] > threshold"))
    assert "has_close_elements([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) raised IndexError" in feedback.observation
    assert "return numbers[10] > threshold" in feedback.observation


def test_code_that_does_not_load_says_why():
    env, _ = started("HumanEval/0")
    feedback = env.step(fenced("def has_close_elements(numbers, threshold) return 1"))
    assert feedback.info["status"] == "failed" and "does not run: SyntaxError" in feedback.observation


def test_calls_are_recorded_once_per_problem(monkeypatch):
    first = humaneval_grading.recording("HumanEval/53", problems()["HumanEval/53"], FAST)
    assert len(first.keys) == 105  # 5 fixed calls, 100 random ones drawn from check()'s own seeded generator
    monkeypatch.setattr(humaneval_grading, "run_python", None)  # a second recording run would fail
    assert humaneval_grading.recording("HumanEval/53", problems()["HumanEval/53"], FAST) is first


@pytest.mark.parametrize("value", [None, True, 3, 2**80, -0.5, 1e-07, 1e16, float("inf"), -float("inf"), "é\n\"\\",
                                   "\ud800", [1, [2.5]], (1, "a"), (), {"a": 1, 5: (2, 3), (1, 2): [None]},
                                   [(1,), {"k": []}], [False, 0, 0.0]])
def test_plain_data_round_trips_with_its_types(value):
    decoded = decode(json.loads(dump(value)))
    assert decoded == value and type(decoded) is type(value)
    if isinstance(value, (list, tuple)) and value:
        assert [type(item) for item in decoded] == [type(item) for item in value]
    assert eval(repr(decoded), vars(harness)) == decoded  # as run_calls receives its arguments


def test_nan_round_trips():
    assert math.isnan(decode(json.loads(dump(float("nan"))))) and math.isnan(eval(repr(float("nan")), vars(harness)))


@pytest.mark.parametrize("value", [{1, 2}, b"bytes", 1j, range(3), [object()], {"k": frozenset()}, True.__class__.mro])
def test_anything_else_is_refused(value):
    with pytest.raises(NotPlainData, match="non-builtin return type"):
        dump(value)


def test_hostile_reply_is_a_failed_attempt_within_the_limits():
    env, _ = started("HumanEval/0")
    began = time.monotonic()
    feedback = env.step(fenced("def has_close_elements(numbers, threshold):\n    while True:\n        pass"))
    assert time.monotonic() - began < FAST.wall_time_s + 3
    assert not feedback.done and feedback.reward == 0 and feedback.info["status"] == "timeout"
    assert "ran too long" in feedback.observation


def _leftovers() -> list[psutil.Process]:
    """Processes of any sandbox uid, or sandbox launchers, still alive (zombies included)."""
    found = []
    for process in psutil.process_iter(["uids", "cmdline"]):
        uids, cmdline = process.info["uids"], process.info["cmdline"] or []
        if (uids and uids.real >= UID_BASE) or any("sandbox_launch" in part for part in cmdline):
            found.append(process)
    return found


@pytest.mark.skipif(os.geteuid() != 0, reason="telling sandbox processes apart needs their own uid (root)")
def test_env_guard_timeout_leaves_no_sandbox_process():
    config = CONFIG.model_copy(update={"sandbox": SandboxConfig(cpu_time_s=20, wall_time_s=20)})
    env, _ = started("HumanEval/0", config)
    hostile = fenced("import os, time\nif os.fork() == 0:\n    os.setsid()\ntime.sleep(60)")
    began = time.monotonic()
    with pytest.raises(EnvFailure) as failure:
        call_env("env.step", env.step, hostile, timeout_s=1)
    assert failure.value.reason == "env-timeout" and time.monotonic() - began < 5
    deadline = time.monotonic() + 3  # the launcher is gone; its init dies by PDEATHSIG, then the pid namespace
    while _leftovers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _leftovers() == []


@pytest.mark.slow
def test_every_canonical_solution_passes():
    env = make_env(CONFIG.model_copy(update={"sandbox": SandboxConfig()}))
    failing = []
    for problem_id, problem in problems().items():
        env.reset({"problem": problem_id})
        if env.step(fenced(problem["prompt"] + problem["canonical_solution"])).reward != 1.0:
            failing.append(problem_id)
    assert failing == []
