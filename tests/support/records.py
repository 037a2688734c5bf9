"""A complete trainer StepRecord with plausible figures; tests override what they look at."""

from sao.status import StepRecord


def step_record(**changes) -> StepRecord:
    fields = dict(step=3, policy_version=7, trained_at=1000.0, rewards=[1.0, 0.0, 1.0], advantages=[1.0, -1.0, 0.0],
                  behaviour_versions=[7, 6, 0], staleness=[0, 1, 9], compression_ratios=[1.0, 2.0, 3.0],
                  sampling_to_training_s=[2.0, 4.0, 6.0], loss=0.25, ratio_mean=1.01, ratio_abs_dev=0.02,
                  clip_fraction=0.1, kl_k3=0.001, value_loss=0.0, grad_norm=3.5, step_s=2.5, wait_s=1.0,
                  forward_backward_s=2.0, optimizer_s=0.5, publish_s=0.5)
    return StepRecord(**{**fields, **changes})
