"""With one rank the engine runs without ZeRO and exchanges no gradient (sao/trainer/engine.py), and the
step is exactly a plain PyTorch step: same rows, same loss, AdamW, clipping; two steps, the losses agree.
"""

import pytest

from support.engine_scripts import TINY_ENGINE, run_script

STEPS = TINY_ENGINE + """
import deepspeed.comm
from sao.trainer.batch import all_rows, plan_batch, rank_loss

collectives = []  # every gradient reduce-scatter or all-reduce the engine made
original = deepspeed.comm.reduce_scatter_fn
deepspeed.comm.reduce_scatter_fn = lambda *a, **k: (collectives.append(1), original(*a, **k))[1]

policy = build_policy(config.policy, 384)
bare = build_policy(config.policy, 384)
bare.load_state_dict(policy.state_dict())
engine = build_engine(policy, cfg)
exchanges = engine.allreduce_gradients
engine.allreduce_gradients = lambda *a, **k: (collectives.append(1), exchanges(*a, **k))[1]
optimizer = torch.optim.AdamW(bare.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
rng = np.random.default_rng(0)
batch = [synthetic_trajectory(i, rng) for i in range(cfg.batch_size)]
plan = plan_batch(batch, RewardBaseline(), cfg, 0)


class Bare:
    module, device = bare, torch.device("cpu")
    def __call__(self, *args, **kwargs):
        return bare(*args, **kwargs)


losses = {"sao": [], "bare": []}
for _ in range(2):
    outcome = train_step(engine, plan, lambda kept: plan_batch(kept, RewardBaseline(), cfg, 0), cfg, 384,
                         batch_layout(cfg, 1)[1])
    losses["sao"].append(outcome.stats.loss)
    loss, _ = rank_loss(Bare(), plan, all_rows(plan, list(range(len(batch)))), len(batch), cfg, 384)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(bare.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    losses["bare"].append(float(loss.detach()))
print(json.dumps({"losses": losses, "collectives": len(collectives), "stage": engine.zero_optimization_stage()}))
shutdown()
"""


@pytest.mark.slow
def test_one_rank_step_exchanges_nothing_and_matches_a_plain_pytorch_step():
    found = run_script(STEPS)
    assert found["stage"] == 0 and found["collectives"] == 0  # nothing to exchange with one rank, and nothing was
    sao, bare = found["losses"]["sao"], found["losses"]["bare"]
    # The same weights and rows: the same loss, up to the order rows are summed in (sao packs them by length).
    assert sao[0] == pytest.approx(bare[0], rel=1e-6)
    # After one update the loss moved, and moved the same way in both: the gradient reached the weights.
    assert abs(bare[1] - bare[0]) > 1e-3
    assert sao[1] == pytest.approx(bare[1], abs=1e-4)


BASE_KL = TINY_ENGINE + """
from sao.policy.weights import frozen_copy
from sao.trainer.batch import plan_batch

cfg = cfg.model_copy(update={"measure_kl_to_base": True})
policy = build_policy(config.policy, 384)
base = frozen_copy(policy)
before = {name: tensor.clone() for name, tensor in base.state_dict().items()}
engine = build_engine(policy, cfg)
rng = np.random.default_rng(0)
batch = [synthetic_trajectory(i, rng) for i in range(cfg.batch_size)]
plan = plan_batch(batch, RewardBaseline(), cfg, 0)
kl, nll = [], []
for _ in range(3):
    outcome = train_step(engine, plan, lambda kept: plan_batch(kept, RewardBaseline(), cfg, 0), cfg, 384,
                         batch_layout(cfg, 1)[1], base_policy=base)
    kl.append(outcome.stats.kl_to_base)
    nll.append(outcome.stats.token_nll)
unchanged = all(torch.equal(before[name], tensor) for name, tensor in base.state_dict().items())
print(json.dumps({"kl": kl, "nll": nll, "base_unchanged": unchanged}))
shutdown()
"""


@pytest.mark.slow
def test_the_kl_to_the_base_starts_at_zero_and_grows_as_the_policy_trains():
    found = run_script(BASE_KL)
    kl = found["kl"]
    assert kl[0] == pytest.approx(0.0, abs=1e-6)  # the first step scores the base's own weights
    assert 0 < kl[1] < kl[2]  # each update moves the policy further from the frozen base
    assert found["base_unchanged"]  # ZeRO-3 and the optimizer never touch the copy
    assert all(value > 0 for value in found["nll"])


WARM_UP = TINY_ENGINE + """
import deepspeed
from sao.trainer.batch import plan_batch
from sao.trainer.engine import set_learning_rate

policy = build_policy(config.policy, 384)
start = {name: tensor.clone() for name, tensor in policy.state_dict().items()}
engine = build_engine(policy, cfg)
rng = np.random.default_rng(0)
batch = [synthetic_trajectory(i, rng) for i in range(cfg.batch_size)]
plan = plan_batch(batch, RewardBaseline(), cfg, 0)


def moved_after_one_step(rate):
    set_learning_rate(engine, rate)
    train_step(engine, plan, lambda kept: plan_batch(kept, RewardBaseline(), cfg, 0), cfg, 384,
               batch_layout(cfg, 1)[1])
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return max(float((tensor - start[name]).abs().max()) for name, tensor in engine.module.state_dict().items())


# Adam's first step moves each weight by about the rate (its moments hold one gradient).
print(json.dumps({"quarter": moved_after_one_step(cfg.learning_rate / 4), "rate": cfg.learning_rate}))
shutdown()
"""


@pytest.mark.slow
def test_a_rate_set_on_the_engine_is_the_rate_its_next_step_uses():
    found = run_script(WARM_UP)
    # A first AdamW step moves a weight by at most about the rate: a quarter of it, a quarter as far.
    assert 0.1 * found["rate"] / 4 < found["quarter"] <= 1.05 * found["rate"] / 4
