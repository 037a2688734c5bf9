"""TurnsEnv whose task 1 waits at its last turn while a gate file exists: a sampler to kill mid-episode.

The gate's path comes from the environment variable SAO_TEST_GATE, so only the process a test starts
with it waits; `<gate>.reached` appears once it does.
"""

import os
import time
from pathlib import Path

from support.turns_env import TurnsEnv

GATE = "SAO_TEST_GATE"


class GatedEnv(TurnsEnv):
    name = "gated"

    def step(self, action):
        gate = os.environ.get(GATE)
        if gate and self.index == 1 and self.left == 1:
            Path(gate + ".reached").touch()
            while Path(gate).exists():
                time.sleep(0.1)
        return super().step(action)
