"""Scripted agents for the text labyrinth, to record long trajectories without a language model.

- `expert_action(env)` plans with the map: it fetches one gem at a time (the nearest it can
  reach), fetching and using keys for locked vaults, and carries each gem back to the altar.
- `RandomAgent` picks uniformly among the admissible commands.
- `ExpertAgent(noise=p)` follows the expert but takes a random admissible command with
  probability p, so its episodes wander, revisit and vary.
"""

from __future__ import annotations

import random
from typing import Protocol

from sao.envs.textworld import Cell, TextWorldEnv, World, routes


class Agent(Protocol):
    name: str

    def act(self, env: TextWorldEnv) -> str: ...


def _first_move(world: World, locks: dict, start: Cell, goals: list[Cell]) -> str | None:
    """The first move towards the nearest goal reachable through open doors (ties: the lowest cell), or None."""
    found = routes(world.exits, start, blocked=locks)
    reachable = [g for g in goals if g in found]
    return found[min(reachable, key=lambda g: (found[g][0], g))][1] if reachable else None


def expert_action(env: TextWorldEnv) -> str:
    """The scripted expert's command in the env's current state."""
    world, state = env.world, env.state
    if world is None or state is None:
        raise RuntimeError("expert_action() before reset()")
    here = state.position
    carried_gems = [item for item in state.inventory if item in world.gems]
    if carried_gems:
        if here == world.altar:
            return f"put {carried_gems[0]} on altar"
        return f"go {_first_move(world, state.locks, here, [world.altar])}"
    remaining = [gem for gem in world.gems if gem not in state.delivered]
    for gem in remaining:
        if gem in state.items[here]:
            return f"take {gem}"
    gem_cells = [cell for cell, items in state.items.items() if any(gem in items for gem in remaining)]
    if (move := _first_move(world, state.locks, here, gem_cells)) is not None:
        return f"go {move}"
    # Every remaining gem is behind a locked door: open the nearest door we hold the key to,
    # else fetch the nearest key that opens one.
    doors = {}  # outside cell of a locked vault -> material
    for passage, material in state.locks.items():
        for cell in passage:
            if len(world.exits[cell]) > 1:
                doors[cell] = material
    held = {cell: m for cell, m in doors.items() if f"{m} key" in state.inventory}
    if here in held:
        return f"unlock {held[here]} door"
    if (move := _first_move(world, state.locks, here, sorted(held))) is not None:
        return f"go {move}"
    keys = {f"{m} key" for m in doors.values()}
    for item in state.items[here]:
        if item in keys:
            return f"take {item}"
    key_cells = [cell for cell, items in state.items.items() if keys & set(items)]
    if (move := _first_move(world, state.locks, here, key_cells)) is not None:
        return f"go {move}"
    return "look"  # unreachable in a generated world: every key lies outside the locked vaults


class ExpertAgent:
    """The expert, taking a random admissible command with probability `noise`."""

    def __init__(self, noise: float = 0.0, seed: int = 0):
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise must be in [0, 1], got {noise}")
        self.noise = noise
        self.rng = random.Random(seed)
        self.name = "expert" if noise == 0 else f"expert(noise={noise:g})"

    def act(self, env: TextWorldEnv) -> str:
        if self.noise and self.rng.random() < self.noise:
            return self.rng.choice(env.admissible_actions())
        return expert_action(env)


class RandomAgent:
    """Uniform over the admissible commands."""

    name = "random"

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def act(self, env: TextWorldEnv) -> str:
        return self.rng.choice(env.admissible_actions())


def make_agent(kind: str, seed: int = 0, noise: float = 0.2) -> Agent:
    """`expert`, `noisy` (expert with `noise`) or `random`."""
    if kind == "expert":
        return ExpertAgent(0.0, seed)
    if kind == "noisy":
        return ExpertAgent(noise, seed)
    if kind == "random":
        return RandomAgent(seed)
    raise ValueError(f"unknown agent {kind!r}: use expert, noisy or random")
