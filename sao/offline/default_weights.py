"""Build the temporal-filter weights that ship with sao, from scripted episodes of both built-in envs.

No LM is involved: arithmetic tutoring dialogues and text-labyrinth episodes (played by the
scripted agents of sao.envs.textworld_agents) are generated deterministically from the seed in
the sampler's step-text format (observation + "\\n" + action), embedded with the default
encoder, and used to train the LSTM and calibrate one keep threshold for both.

    python -m sao.offline.default_weights --seed 0

This build script reads the envs; the compression library itself does not import them.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import random
import sys
from pathlib import Path

import torch

from sao.compression.semantic import DEFAULT_MODEL, load_encoder
from sao.compression.temporal import DEFAULT_WEIGHTS_PATH, save_temporal_weights
from sao.compression.train import train_from_texts
from sao.config import EnvConfig
from sao.envs.textworld import TextWorldEnv
from sao.envs.textworld_agents import make_agent
from sao.offline.episodes import record_episode

logger = logging.getLogger(__name__)

RIGHT = "Correct."
# Feedback after a wrong answer: the plain form, and the wording of sao.envs.arithmetic (copied,
# not imported: compression must not depend on envs). An episode uses one form throughout.
WRONG_FEEDBACK = ["Incorrect. Try again.", "{} is incorrect. Try again: reply with only the final answer."]
NOT_A_NUMBER = "That is not a number. Try again: reply with only the final answer."
ANSWER_STYLES = ["{}", "{}", "{}", "{}", "The answer is {}.", "I think it is {}.", "{}?", "It's {}."]
NON_ANSWERS = ["I don't know.", "Let me think.", "Hmm."]
CLOSINGS = ["Thanks!", "Great, thank you.", "Got it.", "Yay!"]


def question_source() -> str:
    """Where the questions come from, recorded in the weights' JSON: the corpus depends on it."""
    try:
        import reasoning_gym  # noqa: F401  (only whether it imports matters)
    except ImportError:
        return "built-in 'What is a op b?'"
    # The distribution's version: reasoning_gym.__version__ lags it (0.1.19 inside 0.1.25).
    return f"reasoning-gym {importlib.metadata.version('reasoning-gym')} basic_arithmetic"


def arithmetic_questions(seed: int, count: int) -> list[tuple[str, int]]:
    """(question, integer answer) pairs: reasoning-gym's basic_arithmetic, else a fallback."""
    try:
        import reasoning_gym
    except ImportError:
        logger.warning("reasoning_gym is not installed; using built-in 'What is a op b?' questions")
    else:
        dataset = reasoning_gym.create_dataset("basic_arithmetic", size=count, seed=seed,
                                               min_terms=2, max_terms=3, min_digits=1, max_digits=2)
        return [(entry["question"], int(float(entry["answer"]))) for entry in dataset]
    rng = random.Random(seed)
    questions = []
    for _ in range(count):
        a, b, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice("+-*")
        questions.append((f"What is {a} {op} {b}?", {"+": a + b, "-": a - b, "*": a * b}[op]))
    return questions


def _wrong(rng: random.Random, answer: int) -> int:
    return answer + rng.choice([-10, -2, -1, 1, 2, 10]) * rng.randint(1, 3)


def _after_wrong(feedback: str, value: int | None) -> str:
    """The observation that follows a wrong answer `value` (None: the action had no number)."""
    if value is None:
        return NOT_A_NUMBER if "{}" in feedback else feedback
    return feedback.format(value)


def short_episode(rng: random.Random, question: str, answer: int) -> list[str]:
    """1-4 steps: wrong attempts with "incorrect" feedback, usually ending in the right answer."""
    turns = rng.choices([1, 2, 3, 4], weights=[4, 3, 2, 1])[0]
    solved = rng.random() < 0.7
    closing = solved and turns < 4 and rng.random() < 0.2
    feedback = rng.choice(WRONG_FEEDBACK)
    steps, observation = [], question
    for turn in range(turns):
        if turn == turns - 1 and solved:
            value, action = answer, rng.choice(ANSWER_STYLES).format(answer)
        elif rng.random() < 0.05:
            value, action = None, rng.choice(NON_ANSWERS)
        else:
            value = _wrong(rng, answer)
            action = rng.choice(ANSWER_STYLES).format(value)
        steps.append(f"{observation}\n{action}")
        observation = _after_wrong(feedback, value)
    if closing:
        steps.append(f"{RIGHT}\n{rng.choice(CLOSINGS)}")
    return steps


def long_episode(rng: random.Random, question: str, answer: int) -> list[str]:
    """10-40 steps of a stuck learner: runs of one repeated answer under repeated feedback."""
    length = rng.randint(10, 40)
    solve_at = rng.randint(length // 2, length - 1) if rng.random() < 0.6 else length
    feedback = rng.choice(WRONG_FEEDBACK)
    steps, observation = [], question
    style, value, run_left = rng.choice(ANSWER_STYLES), _wrong(rng, answer), rng.randint(3, 10)
    for turn in range(length):
        if turn == solve_at:
            value, style = answer, rng.choice(ANSWER_STYLES)
        elif turn < solve_at and run_left == 0:  # the learner finally changes its answer
            value, style, run_left = _wrong(rng, answer), rng.choice(ANSWER_STYLES), rng.randint(3, 10)
        steps.append(f"{observation}\n{style.format(value)}")
        run_left -= 1
        observation = RIGHT if turn >= solve_at else _after_wrong(feedback, value)
    return steps


def tutoring_episodes(seed: int, short: int = 500, long: int = 60) -> list[list[str]]:
    """The training corpus: `short` 1-4 step episodes and `long` repetitive ones, shuffled."""
    rng = random.Random(seed)
    questions = arithmetic_questions(seed, short + long)
    episodes = [short_episode(rng, q, a) for q, a in questions[:short]]
    episodes += [long_episode(rng, q, a) for q, a in questions[short:]]
    rng.shuffle(episodes)
    return episodes


def labyrinth_episodes(seed: int, count: int = 20) -> list[list[str]]:
    """`count` text-labyrinth episodes of varied size: 4 in 5 by the noisy expert, 1 in 5 random."""
    rng = random.Random(seed)
    env, episodes = TextWorldEnv(), []
    for index in range(count):
        options = {"size": rng.choice([6, 8, 10, 12]), "gems": rng.randint(2, 5),
                   "locked_doors": rng.randint(0, 2), "max_steps": 600}
        task = TextWorldEnv.make_tasks(EnvConfig(name="textworld", seed=1000 + seed, options=options), 1, index)[0]
        agent = make_agent("random" if index % 5 == 4 else "noisy", seed=index, noise=rng.choice([0.1, 0.2, 0.3]))
        episodes.append(record_episode(env, task.task_id, task.spec, agent).texts())
    return episodes


def main(argv: list[str] | None = None) -> None:
    """Generate the corpus, train with hidden=128, calibrate to keep half the steps, write the weights."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_WEIGHTS_PATH)
    parser.add_argument("--short-episodes", type=int, default=500)
    parser.add_argument("--long-episodes", type=int, default=60)
    parser.add_argument("--labyrinth-episodes", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--keep-ratio", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)

    episodes = tutoring_episodes(args.seed, args.short_episodes, args.long_episodes)
    episodes += labyrinth_episodes(args.seed, args.labyrinth_episodes)
    encoder = load_encoder(DEFAULT_MODEL)
    temporal_filter = train_from_texts(episodes, encoder, target_keep_ratio=args.keep_ratio,
                                       hidden=128, epochs=args.epochs, seed=args.seed)
    meta = {**temporal_filter.meta, "threshold": temporal_filter.threshold,
            "command": " ".join(["python -m sao.offline.default_weights", *argv]),
            "corpus": f"synthetic arithmetic tutoring: {args.short_episodes} short + "
                      f"{args.long_episodes} long episodes, questions from {question_source()}; "
                      f"{args.labyrinth_episodes} textworld episodes by the scripted agents"}
    save_temporal_weights(temporal_filter.model, args.out, meta)
    training = meta["training"]
    logger.info("threshold %.4f keeps %.3f of steps; val loss %.4f vs baseline %.4f; wrote %s",
                temporal_filter.threshold, meta["keep_ratio"], training["val_loss"],
                training["baseline_val_loss"], args.out)


if __name__ == "__main__":
    main()
