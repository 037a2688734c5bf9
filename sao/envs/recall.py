"""Recall: an episode states facts no model can know, talks about other things, then asks for one of them.

Turn 0 (the task prompt) gives the rules and states no fact. The middle turns state `facts` facts,
one a turn (`The code of locker 7 is 8315.`, `The courier's name is Veska.`), among distractor
turns of small talk; the last `questions` turns each ask for a different one of them. The policy
is told to repeat each message back (`Turn.reply`); those replies are not judged (reward 0). A
question's reply earns 1 when it ends with the value and names no other value of the episode
(`answer_matches`), else 0. So whatever a question needs is said once, some turns earlier, in this
episode only: with the whole episode in context a model can copy it; truncated to the recent window
it cannot, unless the fact is in it.

Why echoes rather than `ok`: a small policy whose context holds a run of identical replies answers
the question with that reply too (docs/envs.md, "Recall", lists the forms tried).

Held out means never trained on: a value (code or name) belongs to the eval split when the sha256
of `recall/<value>` is even (`is_held_out`), and each split draws its values from its own half
only, so no training episode states a fact whose value a held-out question asks for. The eval
split's episodes also come from a seed of their own (`EVAL_SEED`), the same for every `env.seed`.
Every episode is built deterministically from its task spec.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Any

from sao.config import EnvConfig
from sao.envs.base import Feedback, GenerationDefaults, InvalidTask, check_split, warn_if_turns_cut
from sao.schema import Task

EVAL_SEED = 1_000_003  # held-out episodes: a stream no training run reads, whatever env.seed (as in arithmetic)
HELDOUT_BUCKETS = 2  # a value is held out when sha256("recall/" + value) % this == 0: half of each pool

# Every option a task spec (and env.options) may set, with its default.
DEFAULT_OPTIONS: dict[str, int] = {
    "turns": 16,  # turns in an episode: the rules, the fact and distractor turns, then the questions
    "facts": 4,  # facts stated, each in a turn of its own
    "questions": 1,  # the last turns, each asking for a different fact
}
# Bounds on what a task may ask for (docs/reliability.md): far above any useful task, far below a stalled sampler.
OPTION_LIMITS: dict[str, tuple[int, int]] = {"turns": (3, 256), "facts": (1, 64), "questions": (1, 64)}
MAX_SEED = 2**63  # seed and index are integers of this magnitude at most

LOCKERS = range(1, 100)  # `locker N`: the keys of code facts
CODES = range(1000, 10_000)  # 4-digit values: one or two tokens each, nothing a model could know
ROLES = ["courier", "pilot", "baker", "gardener", "captain", "doctor", "tailor", "miller", "ranger", "scribe",
         "weaver", "smith", "cook", "guard", "sailor", "painter", "jeweller", "mason", "porter", "clerk"]
# Invented names: a consonant-vowel-consonant-consonant-vowel shape (Veska, Tolmi) gives thousands.
ONSETS = "bdfgklmnprstvz"
VOWELS = "aeiou"
CODAS = "lmnrsk"
DISTRACTORS = ["The kettle in the kitchen has started to boil.", "It rained for most of the morning.",
               "A cat is sleeping on the windowsill.", "The train to the coast was a little late today.",
               "Someone in the next room is practising the piano.", "The garden needs watering again.",
               "The library closes early on Sundays.", "There is fresh bread at the market.",
               "The wind has blown some leaves onto the porch.", "The radio is playing an old song.",
               "A new cafe opened at the end of the street.", "The clock in the hall runs a few minutes fast.",
               "Two children are flying a kite in the park.", "The river is higher than usual this week.",
               "The neighbours are painting their fence blue.", "A parcel arrived, but it was for someone else.",
               "The lamp in the study needs a new bulb.", "Snow is forecast for the mountains.",
               "The soup needs a little more salt.", "A choir is rehearsing in the church across the road.",
               "The bus stop has moved to the other corner.", "Somebody left an umbrella by the door.",
               "The museum has a new exhibition of maps.", "The ferry runs every half hour in summer."]
RULES = ("I will tell you some facts, one per message, mixed with small talk. Repeat each message back to me. "
         "When I ask a question, answer it.")
READY = "Ready."  # the reply the rules turn asks for
_WORD = re.compile(r"[^\W_]+")  # a run of letters and digits: `83-15` is two words, neither of them 8315


@dataclass(frozen=True)
class Fact:
    """One fact of an episode: how it is stated, how it is asked for, and the value a reply must be."""

    statement: str
    question: str
    value: str


@dataclass(frozen=True)
class Turn:
    """One user turn: its text, the reply the rules ask for (not judged; what calibration teacher-forces),
    and the fact it asks for (a question turn) or None."""

    text: str
    reply: str
    fact: Fact | None = None


@dataclass(frozen=True)
class Episode:
    """A task's episode: every user turn, the rules first, and every fact it states."""

    turns: list[Turn]
    facts: list[Fact]

    @property
    def values(self) -> tuple[str, ...]:
        return tuple(fact.value for fact in self.facts)


def value_digest(value: str) -> str:
    """The identity of a fact's value: sha256 of `recall/<value>`, hex."""
    return hashlib.sha256(f"recall/{value}".encode()).hexdigest()


def is_held_out(value: str) -> bool:
    """Whether `value` belongs to the eval split's facts (and never to a training episode's)."""
    return int(value_digest(value), 16) % HELDOUT_BUCKETS == 0


def words(text: str) -> list[str]:
    """The case-folded runs of letters and digits of a text: what `answer_matches` compares."""
    return [word.casefold() for word in _WORD.findall(text)]


def answer_matches(reply: str, value: str, stated: tuple[str, ...] = ()) -> bool:
    """The reward rule: the reply's last word is the value (case, spaces and punctuation aside: `8315`,
    `The code of locker 7 is 8315.`), and no other value in `stated` (the episode's) is among its words,
    so listing candidates earns nothing. Neither `83-15` nor `8315a` is `8315`."""
    said = words(reply)
    others = {words(other)[0] for other in stated if other.casefold() != value.casefold()}
    return bool(said) and said[-1] == value.casefold() and not others & set(said)


def task_options(spec: dict[str, Any]) -> dict[str, int]:
    """The episode options of a spec, defaults filled in and checked against OPTION_LIMITS (InvalidTask)."""
    unknown = set(spec) - set(DEFAULT_OPTIONS) - {"seed", "index", "split"}
    if unknown:
        raise InvalidTask(f"recall: unknown option(s) {sorted(unknown)}; known: {sorted(DEFAULT_OPTIONS)}")
    options = {key: spec.get(key, default) for key, default in DEFAULT_OPTIONS.items()}
    for key, value in options.items():
        low, high = OPTION_LIMITS[key]
        if type(value) is not int or not low <= value <= high:
            raise InvalidTask(f"recall: option {key} = {value!r} must be an integer in [{low}, {high}]")
    if options["questions"] > options["facts"]:
        raise InvalidTask(f"recall: option questions = {options['questions']} asks for more facts than the "
                          f"{options['facts']} stated (option facts); each question asks for a different one")
    room = options["turns"] - 1 - options["questions"]  # turns between the rules and the questions
    if options["facts"] > room:
        raise InvalidTask(f"recall: option facts = {options['facts']} does not fit: turns = {options['turns']} "
                          f"leaves {room} turns between the rules and the {options['questions']} question(s)")
    return options


def _check_identity(spec: dict[str, Any]) -> None:
    for key in ("seed", "index"):
        if type(spec.get(key, 0)) is not int or not -MAX_SEED <= spec.get(key, 0) <= MAX_SEED:
            raise InvalidTask(f"recall: {key} must be an integer of magnitude at most 2^63, got {spec.get(key)!r}")
    if spec.get("split", "train") not in ("train", "eval"):
        raise InvalidTask(f"recall: split must be 'train' or 'eval', got {spec.get('split')!r}")


def _draw_value(rng: random.Random, held_out: bool, taken: set[str], make) -> str:
    """A value of the split's half of the pool that this episode has not used (`make(rng)` draws one)."""
    while True:  # each draw is in the split's half with probability about 1/2
        value = make(rng)
        if value not in taken and is_held_out(value) == held_out:
            taken.add(value)
            return value


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(letters) for letters in (ONSETS, VOWELS, CODAS, ONSETS, VOWELS)).capitalize()


def _code(rng: random.Random) -> str:
    return str(rng.choice(CODES))


def _facts(rng: random.Random, count: int, held_out: bool) -> list[Fact]:
    """`count` facts with distinct keys and values, codes and names alternating from a random first kind."""
    lockers = iter(rng.sample(LOCKERS, count))
    roles = iter(rng.sample(ROLES, min(count, len(ROLES))))
    taken: set[str] = set()
    facts = []
    first_kind = rng.randrange(2)
    for position in range(count):
        role = next(roles, None)
        if (position + first_kind) % 2 == 0 or role is None:
            locker, code = next(lockers), _draw_value(rng, held_out, taken, _code)
            facts.append(Fact(f"The code of locker {locker} is {code}.",
                              f"What is the code of locker {locker}? Reply with only the code.", code))
        else:
            name = _draw_value(rng, held_out, taken, _name)
            facts.append(Fact(f"The {role}'s name is {name}.",
                              f"What is the {role}'s name? Reply with only the name.", name))
    return facts


def build_episode(spec: dict[str, Any]) -> Episode:
    """A task's episode; the same spec always gives the same one."""
    _check_identity(spec)
    options = task_options(spec)  # before anything is built
    split = spec.get("split", "train")
    shape = sorted(options.items())
    rng = random.Random(f"sao-recall/{split}/{spec.get('seed', 0)}/{spec.get('index', 0)}/{shape}")
    facts = _facts(rng, options["facts"], held_out=split == "eval")
    middle = options["turns"] - 1 - options["questions"]
    fact_turns = sorted(rng.sample(range(middle), len(facts)))
    distractors = rng.sample(DISTRACTORS, len(DISTRACTORS)) * (middle // len(DISTRACTORS) + 1)  # no repeats till all said
    stated = dict(zip(fact_turns, facts))
    turns = [Turn(RULES, READY)]
    for t in range(middle):
        text = stated[t].statement if t in stated else distractors[t]
        turns.append(Turn(text, text))
    asked = rng.sample(facts, options["questions"])
    turns += [Turn(fact.question, fact.statement, fact) for fact in asked]
    return Episode(turns, facts)


class RecallEnv:
    """Repeat facts and small talk back, then give a stated fact's value: 1 per right answer, else 0."""

    name = "recall"
    generation_defaults = GenerationDefaults(
        system_prompt="You are a careful assistant with a perfect memory. Repeat each message back; when asked a "
                      "question, answer it.", max_new_tokens=24, stop=("\n",))

    @classmethod
    def from_config(cls, config: EnvConfig) -> RecallEnv:
        warn_if_turns_cut(config, "turns", task_options(dict(config.options))["turns"])  # checks the options
        return cls()

    @classmethod
    def make_tasks(cls, config: EnvConfig, count: int, start_index: int = 0, split: str = "train") -> list[Task]:
        """`count` episodes, indices [start_index, start_index + count) of the split, shaped by env.options.

        Train ids are `train/recall/<seed>/<index>` under env.seed; eval ids `eval/recall/<index>`, under
        `EVAL_SEED` whatever env.seed.
        """
        check_split(cls.name, split)
        options = task_options(dict(config.options))
        seed = EVAL_SEED if split == "eval" else config.seed
        prefix = "eval/recall" if split == "eval" else f"train/recall/{seed}"
        return [Task(task_id=f"{prefix}/{index}", env=cls.name,
                     spec={**options, "seed": seed, "index": index, "split": split})
                for index in range(start_index, start_index + count)]

    @staticmethod
    def success(spec: dict[str, Any], step_rewards: list[float]) -> float:
        """The share of the episode's questions answered right (only a right answer earns: 1 each)."""
        return min(1.0, sum(step_rewards) / task_options(spec)["questions"])

    def __init__(self) -> None:
        self.episode: Episode | None = None
        self.turn = 0

    def reset(self, spec: dict[str, Any]) -> str:
        self.episode, self.turn = build_episode(spec), 0
        return self.episode.turns[0].text

    def step(self, action: str) -> Feedback:
        if self.episode is None:
            raise RuntimeError("step() before reset()")
        turns = self.episode.turns
        current = turns[self.turn]
        self.turn += 1
        done = self.turn >= len(turns)
        info: dict[str, Any] = {"turn": self.turn - 1}
        reward = 0.0
        if current.fact is not None:
            correct = answer_matches(action, current.fact.value, self.episode.values)
            reward = float(correct)
            info.update(question=True, correct=correct, value=current.fact.value)
        observation = "" if done else turns[self.turn].text
        return Feedback(observation, reward, done, info)
