"""Multi-turn reasoning-gym tasks (arithmetic by default): a wrong answer gets feedback and another try.

Any reasoning-gym dataset works by name (`env.dataset`); `env.answer_format` says what part of
the reply is scored: its last number (numeric datasets) or its last line (words, lists).

Held out means never trained on: a question belongs to the eval split when the sha256 of its text
is 0 modulo `HELDOUT_BUCKETS`, whatever the seed or dataset index that produced it. The train
split is the generator's stream under `env.seed` with held-out questions skipped; the eval split
is the distinct held-out questions in the order a fixed scan (`EVAL_SEED`) first meets them, the
same for every `env.seed`. A small domain is thus split once and for all: the default one (two
1-digit terms, + and -) has 242 questions, 129 held out and 113 to train on.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from typing import Any

from sao.config import ConfigError, EnvConfig
from sao.envs.base import Feedback, GenerationDefaults, InvalidTask, check_split
from sao.schema import Task

HELDOUT_BUCKETS = 2  # a question is held out when sha256(question) % this == 0: half of any domain
EVAL_SEED = 1_000_003  # the scan that orders the eval split; fixed, so every env.seed is scored on the same tasks
# reasoning-gym draws entry i of a dataset with Random(seed + i): seeds 0, 1, 2 would be one stream
# shifted by one entry (the same questions, in nearly the same order). Training seeds are spread
# this far apart so each env.seed reads its own stretch; env.seed 0 stays reasoning-gym's seed 0.
TRAIN_SEED_STRIDE = 2_000_003
# An entry is read from a dataset built with size = the end of its block of indices, so what index
# i holds never depends on how many tasks were asked for at once (some datasets draw by size).
_BLOCK = 1024
# Entries read without finding a new task of the split: the domain holds no more (a small domain's
# eval split then repeats from its start, like humaneval's). Each read is cheap (microseconds).
_GIVE_UP = 20_000
# What a task spec may ask of reasoning-gym (check_spec): far above the difficulty knobs of any useful task, far
# below what stalls a sampler. Options not named here are bounded by MAX_OPTION_INT, and whatever question they
# give still meets the sampler's prompt bound (sampler.max_prompt_tokens).
OPTION_LIMITS = {"min_terms": 64, "max_terms": 64, "min_digits": 18, "max_digits": 18}
MAX_OPTION_INT = 10**9
MAX_OPTION_LENGTH = 64  # items in a list option (operators ...) or characters in a string one
MAX_OPTIONS = 64
MAX_DATASET_SIZE = 2**31  # reasoning-gym draws entry i lazily, so size only has to fit its integers
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_WORKED_QUESTION = re.compile(r"Calculate (.+?)\.?")  # basic_arithmetic's questions: the expression to work


@lru_cache(maxsize=8)
def _dataset(name: str, size: int, seed: int, options: tuple[tuple[str, Any], ...]):
    # Slow to import (seconds): imported when tasks are made, not by whoever only reads the class (the trainer).
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=size, seed=seed, **dict(options))


def check_dataset_options(name: str, options: dict[str, Any]) -> None:
    """Refuse (ConfigError, one line naming the field) a dataset reasoning-gym lacks, an option its config class
    does not have, or a value that class refuses: before any process starts, not in a sampler's traceback."""
    import dataclasses
    import difflib

    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        near = difflib.get_close_matches(name, DATASETS, n=3)
        raise ConfigError(f"env.dataset {name!r} is not a reasoning-gym dataset"
                          + (f" (did you mean {', '.join(near)}?)" if near else ""))
    config_class = DATASETS[name][1]
    known = sorted(field.name for field in dataclasses.fields(config_class) if field.name not in ("seed", "size"))
    for option in options:
        if option not in known:
            near = difflib.get_close_matches(option, known, n=1)
            raise ConfigError(f"env.dataset_options.{option}: {name} has no such option"
                              + (f" (did you mean {near[0]}?)" if near else "") + f"; its options: {', '.join(known)}")
    try:
        dataset_config = config_class(**dict(_options_key(options)), size=_BLOCK)
        dataset_config.validate()
    except (AssertionError, TypeError, ValueError) as err:
        raise ConfigError(f"env.dataset_options of {name} {options}: {err or type(err).__name__}") from err


def _options_key(options: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Dataset options as a hashable key, lists as the tuples reasoning-gym's configs take."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items()))


def _block_size(index: int) -> int:
    return (index // _BLOCK + 1) * _BLOCK


def question_digest(question: str) -> str:
    """The identity of a question: sha256 of its text, hex."""
    return hashlib.sha256(question.encode()).hexdigest()


def is_held_out(digest: str) -> bool:
    """Whether the question with this digest belongs to the eval split (and never to training)."""
    return int(digest, 16) % HELDOUT_BUCKETS == 0


class _SplitStream:
    """The tasks of one split of one generator, found by reading its entries in order, on demand.

    Position p of the split is always the same dataset entry, so the feeder's waves and a resumed
    run see the same tasks. The train split keeps every non-held-out entry (a question may recur,
    as in the generator); the eval split keeps each held-out question once.
    """

    def __init__(self, name: str, seed: int, options: tuple[tuple[str, Any], ...], split: str):
        self.name, self.seed, self.options = name, seed, options
        self.held_out = split == "eval"
        self.found: list[tuple[int, str]] = []  # (dataset index, question digest), in split order
        self.seen: set[str] = set()
        self.read = 0
        self.exhausted = False

    def __getitem__(self, position: int) -> tuple[int, str]:
        while len(self.found) <= position and not self.exhausted:
            self._find_next()
        return self.found[position % len(self.found)]

    def _find_next(self) -> None:
        for _ in range(_GIVE_UP):
            index, self.read = self.read, self.read + 1
            question = _dataset(self.name, _block_size(index), self.seed, self.options)[index]["question"]
            digest = question_digest(question)
            if is_held_out(digest) == self.held_out and digest not in self.seen:
                if self.held_out:
                    self.seen.add(digest)
                self.found.append((index, digest))
                return
        if not self.found:
            kind = "held-out" if self.held_out else "training"
            raise ValueError(f"env.dataset {self.name!r} with these env.dataset_options gave no {kind} question "
                             f"in {_GIVE_UP} entries (half of all questions, by hash, are held out): widen the domain")
        self.exhausted = True


@lru_cache(maxsize=16)
def _stream(name: str, seed: int, options: tuple[tuple[str, Any], ...], split: str) -> _SplitStream:
    return _SplitStream(name, seed, options, split)


def last_line(text: str) -> str | None:
    """The answer is the last non-empty line of the completion (words, lists, expressions)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


def last_number(text: str) -> str | None:
    """The answer is the last number in the completion (a model may reason before it)."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def every_number(text: str) -> set[str]:
    """Every number a reply states, canonical ("8.0" is "8"): what `last_number` could have picked."""
    return {format(float(number), "g") for number in _NUMBER.findall(text)}


def every_line(text: str) -> set[str]:
    """Every non-empty line of a reply, case-folded: what `last_line` could have picked."""
    return {line.strip().casefold() for line in text.splitlines() if line.strip()}


def check_spec(spec: dict[str, Any]) -> None:
    """Refuse (InvalidTask) a spec whose fields are of the wrong type or whose options ask for more than any
    sensible task: the generator builds the whole question before the env's time limit can help, and a question
    of 100,000 terms costs every sampler that picks it up its memory."""
    types = {"dataset": str, "size": int, "seed": int, "index": int, "options": dict}
    wrong = sorted(key for key, kind in types.items() if type(spec.get(key)) is not kind)
    if wrong:
        raise InvalidTask(f"spec field(s) {wrong} missing or of the wrong type (expected {types})")
    if not 0 <= spec["index"] < spec["size"] <= MAX_DATASET_SIZE:
        raise InvalidTask(f"need 0 <= index < size <= {MAX_DATASET_SIZE}; got index {spec['index']}, size "
                          f"{spec['size']}")
    options = spec["options"]
    if len(options) > MAX_OPTIONS:
        raise InvalidTask(f"{len(options)} options, more than {MAX_OPTIONS}")
    for key, value in options.items():
        limit = OPTION_LIMITS.get(key, MAX_OPTION_INT)
        if isinstance(value, (int, float)) and not -limit <= value <= limit:
            raise InvalidTask(f"option {key} = {value} is outside [-{limit}, {limit}]")
        if isinstance(value, (str, list, dict)) and len(value) > MAX_OPTION_LENGTH:
            raise InvalidTask(f"option {key} holds {len(value)} items, more than {MAX_OPTION_LENGTH}")


class ArithmeticEnv:
    """Up to `max_turns` attempts; a right answer at attempt k earns score * retry_discount**k.

    A retry that offers no new answer earns -repeat_penalty: one that states an answer already
    called wrong anywhere in it, or states none. Such a reply is certainly wrong, so a policy that
    is always right earns what it did; but among the wrong retries, which would all earn 0, it
    sets apart those that try something new (the base model gives no new answer in 77 of 79
    held-out retries). "Anywhere", not just the scored part: else listing the old answer and then
    another dodges it (measured: benchmarks/README.md).
    """

    name = "arithmetic"
    turns_are_attempts = True  # each turn answers the same question again: credit each with its own reward
    generation_defaults = GenerationDefaults(
        system_prompt="You are a calculator. Reply with only the final answer as a single number.", max_new_tokens=24)

    @classmethod
    def from_config(cls, config: EnvConfig) -> ArithmeticEnv:
        return cls(max_turns=config.max_turns, retry_discount=config.retry_discount, answer_format=config.answer_format,
                   repeat_penalty=config.repeat_penalty, reveal_answer=config.reveal_answer)

    @classmethod
    def check_config(cls, config: EnvConfig) -> None:
        """Refuse (ConfigError) env.dataset and env.dataset_options that reasoning-gym would refuse."""
        check_dataset_options(config.dataset, config.dataset_options)

    @classmethod
    def make_tasks(cls, config: EnvConfig, count: int, start_index: int = 0, split: str = "train") -> list[Task]:
        """`count` tasks, positions [start_index, start_index + count) of the split (see the module doc).

        Train ids are `train/<dataset>/<seed>/<position>`; eval ids are `eval/<dataset>/<digest>`,
        named by the question itself, so a small domain's repeats show as repeated ids.
        """
        check_split(cls.name, split)
        seed = EVAL_SEED if split == "eval" else config.seed * TRAIN_SEED_STRIDE
        stream = _stream(config.dataset, seed, _options_key(config.dataset_options), split)
        tasks = []
        for position in range(start_index, start_index + count):
            index, digest = stream[position]
            task_id = (f"eval/{config.dataset}/{digest[:16]}" if split == "eval"
                       else f"train/{config.dataset}/{seed}/{position}")
            spec = {"dataset": config.dataset, "size": _block_size(index), "seed": seed,
                    "options": config.dataset_options, "index": index, "split": split, "question_sha256": digest}
            tasks.append(Task(task_id=task_id, env=cls.name, spec=spec))
        return tasks

    @classmethod
    def skills(cls, spec: dict[str, Any]) -> set[str]:
        """The skill a task needs, from the sign of its reference answer: `answer<0` is what the base model lacks on
        the default domain (a model that only fixes the reply's form gets none of those right); a reference
        answer that is not a number is tagged with nothing."""
        check_spec(spec)
        entry = _dataset(spec["dataset"], spec["size"], spec["seed"], _options_key(spec["options"]))[spec["index"]]
        try:
            answer = float(entry["answer"])
        except (TypeError, ValueError):
            return set()
        return {"answer<0"} if answer < 0 else {"answer>=0"}

    @classmethod
    def corrected_reply(cls, config: EnvConfig, question: str, first: str | None, retry: str) -> str | None:
        """`first` with its answer put right by `retry`'s: the reply `question` should have had, in the first reply's
        own words (trainer.hindsight_reply = corrected). None when the retry states no answer, or `first` none.

        `first` is None when that reply was cut off before its end: its last number is most often an operand it
        was still working on, not an answer. The reply is then the worked answer ("a - b = c" for "Calculate a -
        b."), else the answer alone: a bare number teaches no working, and one sign taught bare spreads to others.
        """
        if config.answer_format == "last_line":
            right = last_line(retry)
            if right is None or first is None:
                return right
            lines = first.rstrip().splitlines()
            return None if not lines else "\n".join([*lines[:-1], right]) + first[len(first.rstrip()):]
        right = last_number(retry)
        if right is None:
            return None
        if first is None:
            worked = _WORKED_QUESTION.fullmatch(question.strip())
            return f"{worked.group(1)} = {right}" if worked else right
        spans = list(_NUMBER.finditer(first))
        return first[:spans[-1].start()] + right + first[spans[-1].end():] if spans else None

    @classmethod
    def first_try_reward(cls, config: EnvConfig, reward: float, attempt: int) -> float:
        """What a first try earns with the answer that earned `reward` at `attempt` (no retry discount)."""
        return reward / config.retry_discount ** attempt

    def __init__(self, max_turns: int = 3, retry_discount: float = 0.5, answer_format: str = "last_number",
                 repeat_penalty: float = 0.0, reveal_answer: bool = False):
        self.extract = {"last_number": last_number, "last_line": last_line}[answer_format]
        self.candidates = {"last_number": every_number, "last_line": every_line}[answer_format]
        self.max_turns = max_turns
        self.retry_discount = retry_discount
        self.repeat_penalty = repeat_penalty
        self.reveal_answer = reveal_answer
        self._rejected: set[str] = set()  # the candidates of answers called wrong in this episode
        self._entry: dict[str, Any] | None = None
        self._dataset = None
        self._turn = 0

    def reset(self, spec: dict[str, Any]) -> str:
        check_spec(spec)  # before reasoning-gym builds anything from it
        self._dataset = _dataset(spec["dataset"], spec["size"], spec["seed"], _options_key(spec["options"]))
        self._entry = self._dataset[spec["index"]]
        self._turn = 0
        self._rejected = set()
        question = self._entry["question"]
        # The feeder chose this entry by its question; a sampler whose reasoning-gym draws another
        # question there (another version) could otherwise train on a held-out one.
        digest = question_digest(question)
        if spec.get("question_sha256", digest) != digest:
            raise ValueError(f"entry {spec['index']} of {spec['dataset']!r} is not the question the task names "
                             f"(sha256 {spec['question_sha256'][:16]}..., got {digest[:16]}...): "
                             "are the feeder and this sampler on the same reasoning-gym version?")
        if spec.get("split") == "train" and is_held_out(digest):
            raise ValueError(f"a held-out question was sent as a training task: {question!r}")
        return question

    def step(self, action: str) -> Feedback:
        if self._entry is None:
            raise RuntimeError("step() before reset()")
        answer = self.extract(action)
        score = float(self._dataset.score_answer(answer, self._entry)) if answer is not None else 0.0
        attempt, self._turn = self._turn, self._turn + 1
        info = {"answer": answer, "score": score, "attempt": attempt}
        if score >= 1.0:
            return Feedback("Correct.", score * self.retry_discount ** attempt, True, info)
        stated = self.candidates(action)
        info["new_answer"] = bool(stated) and not stated & self._rejected
        reward = -self.repeat_penalty if attempt > 0 and not info["new_answer"] else 0.0
        if answer is not None:
            self._rejected |= self.candidates(answer)
        if self._turn >= self.max_turns:
            return Feedback("Incorrect.", reward, True, info)
        missing = "That is not a number." if self.extract is last_number else "That is not an answer."
        hint = missing if answer is None else f"{answer} is incorrect."
        if self.reveal_answer:
            hint += f" The answer is {self._entry['answer']}."
        return Feedback(f"{hint} Try again: reply with only the final answer.", reward, False, info)
