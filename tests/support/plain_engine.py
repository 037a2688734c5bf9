"""The few DeepSpeed engine calls `train_step` makes, served by a plain torch module in this process.

DeepSpeed's process group must not live in pytest's, so in-process tests of the real step path
(`sao/trainer/training_step.py`) use this: AdamW with the trainer's learning rate and gradient
clipping, and every step applied. Unlike ZeRO-3 it never skips a step whose gradient is not finite,
so such a gradient reaches the weights, where a test sees it.
"""

import torch

from sao.config import TrainerConfig


class PlainEngine:
    def __init__(self, module: torch.nn.Module, cfg: TrainerConfig):
        self.module, self.cfg, self.device = module, cfg, torch.device("cpu")
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        self.grad_norm: float | None = None

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.grad_norm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.grad_clip))
        self.optimizer.step()
        self.optimizer.zero_grad()

    def was_step_applied(self) -> bool:
        return True

    def get_global_grad_norm(self) -> float | None:
        return self.grad_norm

    def set_gradient_accumulation_boundary(self, boundary: bool) -> None:
        pass  # every step is one whole batch

    def empty_partition_cache(self) -> None:
        pass  # nothing is partitioned

    def weights_are_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.module.parameters())
