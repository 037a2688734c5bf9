"""TRL's GRPOTrainer on sao's training tasks for a wall-clock budget, saving checkpoints on a schedule.

    python benchmarks/_trl_peer.py SETUP.json

Run by benchmarks/vs_trl.py in the interpreter that has `trl` (`pip install -e ".[peers]"`); it
reads everything from SETUP.json: the HF model folder sao converted, the training tasks (sao's
train split: chat messages and the task spec), the sampling settings, the learning rate, the seed,
the budget and the wall times at which to save. The reward is sao's env scoring the first answer
(1 when right), what sao's first turn earns. It writes OUT_DIR/ckpt-K (HF folders) and
OUT_DIR/checkpoints.json: per checkpoint its wall time since the benchmark launched this process,
optimizer steps and generated tokens (completion tokens, all of them); and OUT_DIR/steps.json, each
optimizer step's end in wall seconds since the launch. SETUP's `max_steps` stops it after that many
steps (default: only the budget does); its `bf16` runs the trainer under bf16 autocast on the CPU.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(setup_path: str) -> None:
    setup = json.loads(Path(setup_path).read_text())
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from sao.config import EnvConfig
    from sao.envs.registry import make_env

    torch.set_num_threads(setup["threads"])
    out = Path(setup["out_dir"])
    launched, budget_s, save_at = setup["launched_at"], setup["minutes"] * 60, list(setup["save_at_s"])
    env = make_env(EnvConfig.model_validate(setup["env"]))
    generated = {"tokens": 0}

    def first_answer_reward(prompts, completions, completion_ids=None, spec=None, **_):
        rewards = []
        for index, completion in enumerate(completions):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            env.reset(json.loads(spec[index]))
            rewards.append(float(env.step(text).reward >= 1.0))
            generated["tokens"] += len(completion_ids[index]) if completion_ids is not None else 0
        return rewards

    checkpoints: list[dict] = []
    step_ends: list[float] = []

    def save(model, step: int) -> None:
        folder = out / f"ckpt-{len(checkpoints)}"
        model.save_pretrained(folder, safe_serialization=True)
        checkpoints.append({"path": str(folder), "wall_s": time.time() - launched, "step": step,
                            "tokens": generated["tokens"]})
        (out / "checkpoints.json").write_text(json.dumps(checkpoints, indent=1))

    class Budget(TrainerCallback):
        """Saves the weights each scheduled wall time sees, and at the budget saves once more and stops.

        A point's checkpoint is saved at the last step end before it (when the next step, as long as this
        one, would end past it), so it is on record by the point, as sao's last version published before it is.
        """

        last_end = 0.0

        def on_train_begin(self, args, state, control, **_):
            self.last_end = time.time() - launched

        def on_step_end(self, args, state, control, model=None, **_):
            elapsed = time.time() - launched
            step_s, self.last_end = elapsed - self.last_end, elapsed
            step_ends.append(elapsed)
            (out / "steps.json").write_text(json.dumps(step_ends))
            if elapsed >= budget_s:
                save(model, state.global_step)
                control.should_training_stop = True
            elif save_at and elapsed + step_s > save_at[0]:
                while save_at and elapsed + step_s > save_at[0]:
                    save_at.pop(0)
                save(model, state.global_step)
            return control

    tokenizer = AutoTokenizer.from_pretrained(setup["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(setup["model_dir"], dtype=torch.float32)
    dataset = Dataset.from_list([{"prompt": task["messages"], "spec": json.dumps(task["spec"])}
                                 for task in setup["tasks"]])
    config = GRPOConfig(output_dir=str(out / "trainer"), use_cpu=True, bf16=setup.get("bf16", False),
                        report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=10**9,
                        seed=setup["seed"], max_steps=setup.get("max_steps", 10**9), lr_scheduler_type="constant",
                        **setup["grpo"])
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=first_answer_reward,
                          args=config, train_dataset=dataset, callbacks=[Budget()])
    trainer.train()
    if not checkpoints or checkpoints[-1]["step"] != trainer.state.global_step:
        save(trainer.model, trainer.state.global_step)  # the task list ran out before the budget


if __name__ == "__main__":
    main(sys.argv[1])
