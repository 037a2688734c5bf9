"""A long-horizon text labyrinth: fetch gems from far vaults and bring them to the altar.

Episodes run hundreds of turns: a maze of long corridors (a depth-first spanning tree of a grid
with a few extra loops), gems in dead-end vaults, some vaults behind locked doors whose keys lie
elsewhere, and distractor items. Every world is built deterministically from its task spec.
Putting a gem on the altar earns 1/gems, so the return is the share of gems delivered; an
episode ends when all are delivered or after `max_steps` actions. The inventory is not shown
unless asked for, so what the agent already carries lives only in its history: the memory
that context compression must keep.

Scripted agents (an expert that plans with the world's map, a random policy) are in
`sao.envs.textworld_agents`. To sample it with an LM, set `env.name = "textworld"`, shape the
worlds with `env.options` (`DEFAULT_OPTIONS` below) and raise `env.max_turns` to `max_steps`:
the sampler stops an episode after `env.max_turns` turns.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from sao.config import EnvConfig
from sao.envs.base import Feedback, GenerationDefaults, InvalidTask, check_split, warn_if_turns_cut
from sao.schema import Task

Cell = tuple[int, int]

MOVES = {"north": (0, -1), "south": (0, 1), "east": (1, 0), "west": (-1, 0)}
OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}
GEMS = ["ruby", "emerald", "sapphire", "topaz", "amethyst", "opal", "garnet", "pearl"]
MATERIALS = ["iron", "brass", "silver", "copper", "bronze", "bone"]
DISTRACTORS = ["lantern", "coil of rope", "old map", "wooden shield", "silver goblet", "torn scroll",
               "candle stub", "dented helmet", "clay jar", "bent sword"]
FLAVOURS = ["Moss grows between the granite blocks.", "Water drips from the low ceiling.",
            "Faded murals cover the walls.", "The air smells of old smoke.", "Roots hang through cracks above.",
            "Your steps echo on polished marble.", "Cobwebs fill every corner.", "Sand has drifted across the floor."]
HALL_ADJECTIVES = ["Copper", "Silent", "Broken", "Mossy", "Sunken", "Painted", "Frozen", "Crooked", "Hollow",
                   "Gilded", "Ashen", "Narrow"]
HALL_NOUNS = ["Hall", "Crossing", "Chamber", "Crypt", "Gallery", "Cellar"]
COMMANDS = ("go <direction>, take <item>, drop <item>, put <gem> on altar, unlock <material> door, "
            "look, inventory")

# Every option a task spec (and env.options) may set, with its default.
DEFAULT_OPTIONS: dict[str, int] = {
    "size": 12,  # the maze is size x size rooms
    "gems": 4,  # gems to deliver
    "locked_doors": 2,  # vaults behind a locked door (at most `gems`)
    "distractors": 6,  # useless items lying around
    "loops": 4,  # extra passages added to the spanning tree, so routes are not unique
    "max_steps": 1000,  # actions before the episode ends unsolved
}
# Bounds on what a task may ask for (docs/reliability.md): far above any useful task, far below a stalled sampler.
MAX_SIZE = 64
MAX_STEPS = 100_000
EVAL_SEED_OFFSET = 1_000_003  # held-out worlds: a seed no training run uses by default (as in arithmetic)


def _listing(names: list[str], article: str = "a") -> str:
    names = [f"{'an' if article == 'a' and name[0] in 'aeiou' else article} {name}" for name in names]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


@dataclass
class World:
    """The static map of one task, plus where the items start."""

    size: int
    exits: dict[Cell, dict[str, Cell]]
    locks: dict[frozenset[Cell], str]  # a locked passage -> the material of its door and key
    items: dict[Cell, list[str]]
    gems: list[str]
    altar: Cell
    names: dict[Cell, str] = field(default_factory=dict)  # junction halls
    flavours: dict[str, str] = field(default_factory=dict)  # region -> flavour sentence

    def region(self, cell: Cell) -> str:
        half, (x, y) = self.size / 2, cell
        if abs(x + 0.5 - half) <= 1 and abs(y + 0.5 - half) <= 1:
            return "central"
        return ("north" if y < half else "south") + "-" + ("west" if x < half else "east")


def _maze(rng: random.Random, size: int, start: Cell) -> dict[Cell, dict[str, Cell]]:
    """A depth-first spanning tree of the grid: long winding corridors, few junctions."""
    exits: dict[Cell, dict[str, Cell]] = {(x, y): {} for x in range(size) for y in range(size)}
    stack, seen = [start], {start}
    while stack:
        x, y = stack[-1]
        options = [(d, (x + dx, y + dy)) for d, (dx, dy) in MOVES.items() if (x + dx, y + dy) in exits
                   and (x + dx, y + dy) not in seen]
        if not options:
            stack.pop()
            continue
        direction, nxt = rng.choice(options)
        exits[(x, y)][direction], exits[nxt][OPPOSITE[direction]] = nxt, (x, y)
        seen.add(nxt)
        stack.append(nxt)
    return exits


def _add_loops(rng: random.Random, exits: dict[Cell, dict[str, Cell]], count: int) -> None:
    """Open `count` extra passages between rooms that are not dead ends (vaults stay dead ends)."""
    candidates = [(cell, d, (cell[0] + dx, cell[1] + dy)) for cell in sorted(exits) for d, (dx, dy) in MOVES.items()
                  if (cell[0] + dx, cell[1] + dy) in exits and d not in exits[cell]]
    rng.shuffle(candidates)
    for cell, direction, other in candidates:
        if count <= 0:
            break
        if direction not in exits[cell] and len(exits[cell]) >= 2 and len(exits[other]) >= 2:
            exits[cell][direction], exits[other][OPPOSITE[direction]] = other, cell
            count -= 1


def routes(exits: dict[Cell, dict[str, Cell]], start: Cell,
           blocked: Collection[frozenset[Cell]] = frozenset()) -> dict[Cell, tuple[int, str]]:
    """BFS from `start` to every room reachable without crossing a `blocked` passage: its distance, and the
    direction of the first step of a shortest path there ("" for `start` itself)."""
    found, queue = {start: (0, "")}, deque([start])
    while queue:
        cell = queue.popleft()
        depth, first = found[cell]
        for direction, nxt in exits[cell].items():
            if nxt not in found and frozenset((cell, nxt)) not in blocked:
                found[nxt] = (depth + 1, first or direction)
                queue.append(nxt)
    return found


def build_world(spec: dict[str, Any]) -> World:
    """The world of a task spec; the same spec always gives the same world."""
    options = task_options(spec)
    size, gem_count = options["size"], options["gems"]
    # The step budget does not shape the world: the same task with fewer moves is the same maze.
    shape = sorted((k, v) for k, v in options.items() if k != "max_steps")
    rng = random.Random(f"sao-textworld/{spec.get('seed', 0)}/{spec.get('index', 0)}/{shape}")
    altar = (size // 2, size // 2)
    exits = _maze(rng, size, altar)
    _add_loops(rng, exits, options["loops"])
    depth = {cell: distance for cell, (distance, _) in routes(exits, altar).items()}
    dead_ends = [c for c in sorted(exits) if len(exits[c]) == 1 and c != altar]
    dead_ends.sort(key=lambda c: -depth[c])
    far = dead_ends[: max(2 * gem_count, gem_count)]
    vaults = rng.sample(far, min(gem_count, len(far)))
    others = [c for c in sorted(exits, key=lambda c: -depth[c]) if c != altar and c not in vaults]
    vaults += others[: gem_count - len(vaults)]  # a tiny maze has too few dead ends
    gems = rng.sample(GEMS, gem_count)
    items: dict[Cell, list[str]] = {cell: [] for cell in exits}
    for gem, cell in zip(gems, vaults):
        items[cell].append(gem)
    locks: dict[frozenset[Cell], str] = {}
    materials = rng.sample(MATERIALS, min(options["locked_doors"], gem_count, len(MATERIALS)))
    locked_vaults = [v for v in vaults if len(exits[v]) == 1][: len(materials)]
    free_cells = [c for c in sorted(exits) if c not in locked_vaults and c != altar]
    for material, vault in zip(materials, locked_vaults):
        locks[frozenset((vault, next(iter(exits[vault].values()))))] = material
        items[rng.choice(free_cells)].append(f"{material} key")
    for name in rng.sample(DISTRACTORS, min(options["distractors"], len(DISTRACTORS))):
        items[rng.choice(free_cells)].append(name)
    halls = [f"the {a} {n}" for a in HALL_ADJECTIVES for n in HALL_NOUNS]
    rng.shuffle(halls)
    junctions = [c for c in sorted(exits) if len(exits[c]) >= 3 and c != altar]
    regions = ["central", "north-west", "north-east", "south-west", "south-east"]
    return World(size=size, exits=exits, locks=locks, items=items, gems=gems, altar=altar,
                 names=dict(zip(junctions, halls)), flavours=dict(zip(regions, rng.sample(FLAVOURS, len(regions)))))


def task_options(spec: dict[str, Any]) -> dict[str, int]:
    """The world options of a spec, defaults filled in and checked."""
    unknown = set(spec) - set(DEFAULT_OPTIONS) - {"seed", "index"}
    if unknown:
        raise InvalidTask(f"textworld: unknown option(s) {sorted(unknown)}; known: {sorted(DEFAULT_OPTIONS)}")
    options = {key: spec.get(key, default) for key, default in DEFAULT_OPTIONS.items()}
    wrong = sorted(key for key, value in options.items() if type(value) is not int)
    if wrong:
        raise InvalidTask(f"textworld: option(s) {wrong} must be integers")
    # A task is untrusted input: the maze is built in full before the first move, so its size is bounded.
    if (not 3 <= options["size"] <= MAX_SIZE or not 1 <= options["gems"] <= len(GEMS)
            or not 1 <= options["max_steps"] <= MAX_STEPS or not 0 <= options["loops"] <= options["size"] ** 2
            or options["locked_doors"] < 0 or options["distractors"] < 0):
        raise InvalidTask(f"textworld: need size >= 3 and <= {MAX_SIZE}, 1 <= gems <= {len(GEMS)}, 1 <= max_steps <= "
                          f"{MAX_STEPS}, 0 <= loops <= size^2, locked_doors and distractors >= 0; got {options}")
    return options


@dataclass
class State:
    """What changes during an episode."""

    position: Cell
    items: dict[Cell, list[str]]
    locks: dict[frozenset[Cell], str]
    inventory: list[str] = field(default_factory=list)
    delivered: list[str] = field(default_factory=list)
    steps: int = 0


class TextWorldEnv:
    """Deliver every gem to the altar within `max_steps` actions; each delivery earns 1/gems."""

    name = "textworld"
    generation_defaults = GenerationDefaults(
        system_prompt="You are exploring a text adventure. Reply with exactly one command.", max_new_tokens=16)

    @classmethod
    def from_config(cls, config: EnvConfig) -> TextWorldEnv:
        warn_if_turns_cut(config, "max_steps", task_options(dict(config.options))["max_steps"])  # checks options
        return cls()

    @classmethod
    def make_tasks(cls, config: EnvConfig, count: int, start_index: int = 0, split: str = "train") -> list[Task]:
        """`count` worlds, indices [start_index, start_index + count) of the split, shaped by env.options.

        The eval split builds its worlds from another seed (`seed + EVAL_SEED_OFFSET`), so held-out
        mazes are not the training ones; its ids start with `eval/` (train ids keep their old form).
        """
        check_split(cls.name, split)
        options = task_options(dict(config.options))
        seed = config.seed + (EVAL_SEED_OFFSET if split == "eval" else 0)
        prefix = "eval/" if split == "eval" else ""
        return [Task(task_id=f"{prefix}textworld/{seed}/{index}", env=cls.name,
                     spec={**options, "seed": seed, "index": index})
                for index in range(start_index, start_index + count)]

    def __init__(self) -> None:
        self.world: World | None = None
        self.state: State | None = None
        self.max_steps = DEFAULT_OPTIONS["max_steps"]

    # -- the Env protocol -------------------------------------------------------------------
    def reset(self, spec: dict[str, Any]) -> str:
        self.world = build_world(spec)
        self.max_steps = task_options(spec)["max_steps"]
        self.state = State(position=self.world.altar, items={c: list(v) for c, v in self.world.items.items()},
                           locks=dict(self.world.locks))
        gems = _listing(self.world.gems, article="the")
        return (f"You stand in an ancient labyrinth. Bring {gems} to the altar in the Atrium. "
                f"Some vaults are behind locked doors; their keys lie elsewhere. You have "
                f"{self.max_steps} moves. Commands: {COMMANDS}. Reply with one command.\n\n{self.describe()}")

    def step(self, action: str) -> Feedback:
        world, state = self._require_started()
        state.steps += 1
        message, reward = self._act(" ".join(action.lower().strip().rstrip(".!").split()))
        delivered = len(state.delivered)
        solved = delivered == len(world.gems)
        info = {"delivered": delivered, "gems": len(world.gems), "steps": state.steps, "solved": solved}
        if solved:
            return Feedback(f"{message}\nEvery gem is on the altar. You win!", reward, True, info)
        if state.steps >= self.max_steps:
            return Feedback(f"{message}\nYou are out of moves: {delivered} of {len(world.gems)} gems are on the "
                            "altar.", reward, True, info)
        return Feedback(message, reward, False, info)

    # -- what the scripted agents may look at ------------------------------------------------
    def admissible_actions(self) -> list[str]:
        """Commands that make sense here (TextWorld's "admissible commands"), in a stable order."""
        world, state = self._require_started()
        here = state.position
        actions = [f"go {d}" for d in world.exits[here]]
        actions += [f"take {item}" for item in state.items[here]]
        actions += [f"drop {item}" for item in state.inventory]
        if here == world.altar:
            actions += [f"put {item} on altar" for item in state.inventory if item in world.gems]
        for nxt in world.exits[here].values():
            material = state.locks.get(frozenset((here, nxt)))
            if material and f"{material} key" in state.inventory:
                actions.append(f"unlock {material} door")
        return actions + ["look", "inventory"]

    def describe(self) -> str:
        """The current room, its exits, locked doors and the items lying here."""
        world, state = self._require_started()
        here = state.position
        exits = world.exits[here]
        region = world.region(here)
        if here == world.altar:
            text = "The Atrium, a round hall at the heart of the labyrinth. A stone altar stands in the middle."
            if state.delivered:
                text += f" On it lie {_listing(state.delivered)}."
        elif here in world.names:
            text = f"{world.names[here][0].upper()}{world.names[here][1:]}, a junction in the {region} wing."
        elif len(exits) == 1:
            text = f"A dead end in the {region} wing."
        elif set(exits) in ({"north", "south"}, {"east", "west"}):
            ends = "north to south" if "north" in exits else "east to west"
            text = f"A long corridor in the {region} wing, running {ends}."
        else:
            text = f"A bend in the corridor in the {region} wing."
        text += f" {world.flavours[region]} Exits: {', '.join(d for d in MOVES if d in exits)}."
        for direction, nxt in exits.items():
            material = state.locks.get(frozenset((here, nxt)))
            if material:
                text += f" A locked {material} door bars the way {direction}."
        if state.items[here]:
            text += f" You see {_listing(state.items[here])}."
        return text

    # -- actions --------------------------------------------------------------------------------
    def _require_started(self) -> tuple[World, State]:
        if self.world is None or self.state is None:
            raise RuntimeError("step() before reset()")
        return self.world, self.state

    def _act(self, command: str) -> tuple[str, float]:
        verb, _, rest = command.partition(" ")
        rest = rest.removeprefix("the ").strip()
        if verb in MOVES or verb in ("n", "s", "e", "w"):
            verb, rest = "go", verb
        if verb == "go":
            return self._go({"n": "north", "s": "south", "e": "east", "w": "west"}.get(rest, rest)), 0.0
        if verb in ("take", "drop"):
            return self._carry(verb, rest), 0.0
        if verb == "put":
            return self._put(rest.removesuffix(" on the altar").removesuffix(" on altar").removeprefix("the "))
        if verb == "unlock":
            return self._unlock(rest.removesuffix(" door")), 0.0
        if command in ("look", "l"):
            return self.describe(), 0.0
        if command in ("inventory", "i"):
            inventory = self.state.inventory
            return f"You are carrying {_listing(inventory) if inventory else 'nothing'}.", 0.0
        return f"I don't understand that. Commands: {COMMANDS}.", 0.0

    def _go(self, direction: str) -> str:
        world, state = self._require_started()
        nxt = world.exits[state.position].get(direction)
        if nxt is None:
            return f"You cannot go {direction} from here."
        material = state.locks.get(frozenset((state.position, nxt)))
        if material:
            return f"The {material} door is locked."
        state.position = nxt
        return f"You go {direction}.\n{self.describe()}"

    def _carry(self, verb: str, item: str) -> str:
        """`take` moves an item from the room into the inventory, `drop` the other way."""
        room, inventory = self.state.items[self.state.position], self.state.inventory
        source, target = (room, inventory) if verb == "take" else (inventory, room)
        if item not in source:
            missing = f"There is no {item} here." if verb == "take" else f"You are not carrying {item}."
            return missing if item else f"{verb.capitalize()} what?"
        source.remove(item)
        target.append(item)
        return f"You {verb} the {item}."

    def _put(self, item: str) -> tuple[str, float]:
        world, state = self._require_started()
        if state.position != world.altar:
            return "There is no altar here.", 0.0
        if item not in state.inventory:
            return f"You are not carrying {item}.", 0.0
        if item not in world.gems:
            return f"The altar rejects the {item}.", 0.0
        state.inventory.remove(item)
        state.delivered.append(item)
        return (f"You put the {item} on the altar. {len(state.delivered)} of {len(world.gems)} gems are on the "
                "altar.", 1.0 / len(world.gems))

    def _unlock(self, material: str) -> str:
        world, state = self._require_started()
        for nxt in world.exits[state.position].values():
            passage = frozenset((state.position, nxt))
            if state.locks.get(passage) == material:
                if f"{material} key" not in state.inventory:
                    return f"You have no {material} key."
                del state.locks[passage]
                return f"You unlock the {material} door with the {material} key."
        return f"There is no locked {material} door here." if material else "Unlock what?"
