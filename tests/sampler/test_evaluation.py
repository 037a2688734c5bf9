"""`sao eval`: held-out tasks, base or published versions, clear error for a pruned version."""

import json

import pytest
import torch

from sao.envs.registry import make_tasks
from sao.policy.weights import build_policy, unique_state_dict, write_weights
from sao.sampler.evaluation import evaluate, weights_of
from sao.schema import PolicyAnnouncement


def test_eval_split_is_disjoint_from_training(tiny_config):
    train = make_tasks(tiny_config.env, 50)
    held_out = make_tasks(tiny_config.env, 50, split="eval")
    assert not {t.task_id for t in train} & {t.task_id for t in held_out}
    assert {t.spec["seed"] for t in train}.isdisjoint({t.spec["seed"] for t in held_out})


def test_eval_scores_a_published_version(tiny_config, encoder, tmp_path):
    policy = build_policy(tiny_config.policy, encoder.dim)
    torch.nn.init.normal_(policy.projector.weight, std=0.01)
    path = tmp_path / "policy" / "policy-v000003.safetensors"
    sha = write_weights(unique_state_dict(policy.state_dict()), path)
    path.with_suffix(".json").write_text(json.dumps(
        PolicyAnnouncement(3, str(path), sha, path.stat().st_size, 6).to_wire()))
    result = evaluate(tiny_config, tmp_path, version=3, num_tasks=2)
    assert result["version"] == 3 and 0 <= result["reward_mean"] <= 1
    assert json.loads((tmp_path / "eval" / "v000003.json").read_text()) == result
    with pytest.raises(FileNotFoundError, match=r"kept: \[3\]"):
        weights_of(tmp_path, 1)


@pytest.mark.slow
def test_eval_runs_on_the_labyrinth(tiny_config, tmp_path):
    # The labyrinth's eval split once raised TypeError (its make_tasks had no `split`).
    env = tiny_config.env.model_copy(update={"name": "textworld", "max_turns": 3,
                                             "options": {"size": 3, "gems": 1, "locked_doors": 0, "max_steps": 3}})
    config = tiny_config.model_copy(update={"env": env})
    result = evaluate(config, tmp_path, version=0, num_tasks=2)
    assert (result["tasks"], result["split"]) == (2, "eval") and 0 <= result["reward_mean"] <= 1
    assert json.loads((tmp_path / "eval" / "v000000.json").read_text()) == result
