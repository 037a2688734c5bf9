"""Building a ZeRO-3 engine (several ranks' engine, asked for here on one) skips DeepSpeed's set-up waste
(sao/trainer/engine.py) and leaves no trace of it.

Run in a fresh interpreter: what a module imports is only visible before anything else imported it.
"""

import json
import subprocess
import sys

import pytest

BUILD = """
import json, os, sys
import torch
import deepspeed
from sao.config import load_config
from sao.policy.weights import build_policy
from sao.trainer.engine import build_engine, gather_full_state, shutdown

torch.set_num_threads(1)
config = load_config(overrides=['policy.model="tiny"', "trainer.deepspeed={ zero_optimization = { stage = 3 } }"],
                     environ={})
policy = build_policy(config.policy, 384)
expected = {name: tensor.clone() for name, tensor in policy.state_dict().items()}
engine = build_engine(policy, config.trainer)
weights = gather_full_state(engine)
print(json.dumps({
    "inductor_imported": "torch._inductor.compile_fx" in sys.modules,
    "muon_checked": "deepspeed.runtime.zero.muon.muon_optimizer" in sys.modules,
    "compatible_ops": vars(deepspeed.ops).get("__compatible_ops__"),
    "dynamo_env": os.environ.get("TORCHDYNAMO_DISABLE"),
    "parameter_repr": repr(torch.nn.Parameter(torch.zeros(2))),
    "same_weights": all(torch.equal(weights[name], expected[name]) for name in weights),
}))
shutdown()
"""


@pytest.mark.slow
def test_engine_set_up_compiles_nothing_probes_no_op_and_restores_what_it_patched():
    result = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    built = json.loads(result.stdout.strip().splitlines()[-1])
    # DeepSpeed still checks the optimizer against Muon; that import no longer loads torch's compiler.
    assert built["muon_checked"] and not built["inductor_imported"]
    # Only the shm comm op is marked, so DeepSpeed never probed its ops by building them.
    assert built["compatible_ops"] == {"deepspeed_shm_comm": False}
    assert built["dynamo_env"] is None
    assert built["parameter_repr"].startswith("Parameter containing:")
    assert built["same_weights"]  # what is trained is the model given, unchanged
