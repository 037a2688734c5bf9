"""The trainer state a checkpoint stores reads back as written, and under the key names older checkpoints used."""

import json
from dataclasses import asdict

from sao.trainer.checkpoint import TrainerState


def test_the_state_round_trips_through_json():
    state = TrainerState(step=3, policy_version=2, offsets={0: 7, 1: 2}, dead_lettered_offsets={0: [7, 9]})
    assert TrainerState.from_json(json.loads(json.dumps(asdict(state)))) == state


def test_a_checkpoint_that_wrote_refused_offsets_still_resumes_past_its_dead_letters():
    written = {"step": 3, "policy_version": 2, "offsets": {"0": 7}, "refused_offsets": {"0": [7, 9]}, "files": {}}
    state = TrainerState.from_json(written)
    assert state.offsets == {0: 7} and state.dead_lettered_offsets == {0: [7, 9]}
