"""How likely is a policy to give the right answer the base model never gives? Teacher-forced, no sampling.

    python benchmarks/skill_probe.py [--model smollm2-135m-instruct | HF_FOLDER] [--every 1] [--json PATH]

On the default arithmetic domain's questions whose answer is negative (the skill the base model
lacks), the policy's own greedy reply is the baseline: the right reply is that reply with its
last number replaced by the right one, so both have the policy's own form. Printed per context,
as mean and median probability of the whole reply (its tokens and the end of turn):
- the first try: the right reply, and the greedy reply itself;
- a retry after the greedy reply was called wrong, with the env's own feedback and with two
  more telling ones ("too high", "the answer is below zero").
A skill that RL can teach by reward alone must first be sampled: a first-try probability of 1e-3
means about one right reply in a thousand draws on those questions. The headline is the right
reply's mean first-try probability against the greedy reply's. `sao export` writes a run's
version as a folder this reads.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch

from sao.config import EnvConfig
from sao.envs.arithmetic import ArithmeticEnv, last_number
from sao.policy.loading import load_language_model, load_tokenizer

FEEDBACKS = {
    "retry, the env's feedback": "{answer} is incorrect. Try again: reply with only the final answer.",
    "retry, 'too high'": "{answer} is too high. Try again: reply with only the final answer.",
    "retry, 'below zero'": "{answer} is incorrect; the answer is below zero. Try again: reply with only the final answer.",
}
CACHE = "~/.cache/sao/models"


def negative_questions(every: int) -> list[dict]:
    """Every distinct question of the default domain whose answer is below zero (every `every`-th one)."""
    import reasoning_gym

    config = EnvConfig()
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in config.dataset_options.items()}
    entries = {}
    for entry in reasoning_gym.create_dataset(config.dataset, size=4000, seed=0, **options):
        entries.setdefault(entry["question"], entry)
    negative = [e for e in entries.values() if float(e["answer"]) < 0]
    return sorted(negative, key=lambda e: e["question"])[::every]


class Probe:
    def __init__(self, model: str, threads: int):
        torch.set_num_threads(threads)
        self.tokenizer = load_tokenizer(model, CACHE)
        self.lm = load_language_model(model, CACHE).eval()
        self.system = ArithmeticEnv.generation_defaults.system_prompt

    def _ids(self, messages: list[dict]) -> torch.Tensor:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, return_tensors="pt").input_ids

    def opening(self, question: str) -> list[dict]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": question}]

    @torch.no_grad()
    def greedy(self, messages: list[dict], max_new_tokens: int = 24) -> str:
        ids = self._ids(messages)
        out = self.lm.generate(ids, do_sample=False, max_new_tokens=max_new_tokens,
                               pad_token_id=self.tokenizer.eos_token_id)
        return self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()

    @torch.no_grad()
    def probability(self, messages: list[dict], reply: str) -> float:
        """P(reply, then the end of turn | messages), teacher-forced."""
        context = self._ids(messages)
        end = self.tokenizer.eos_token or ""
        reply_ids = self.tokenizer(reply + end, return_tensors="pt", add_special_tokens=False).input_ids
        ids = torch.cat([context, reply_ids], dim=1)
        logprobs = torch.log_softmax(self.lm(ids).logits[0, :-1].float(), dim=-1)
        targets = ids[0, 1:]
        n = reply_ids.shape[1]
        return math.exp(logprobs[-n:].gather(1, targets[-n:, None]).sum().item())


def right_reply(greedy: str, answer: str) -> str:
    """The greedy reply with its last number replaced by the right answer (the right answer alone if it has none)."""
    stated = last_number(greedy)
    if stated is None:
        return answer
    at = greedy.rfind(stated)
    return greedy[:at] + answer + greedy[at + len(stated):]


def summary(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "n": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="policy.model: a name or an HF folder")
    parser.add_argument("--every", type=int, default=1, help="probe every k-th negative question")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.every < 1:
        raise SystemExit("--every must be at least 1")

    probe = Probe(args.model, args.threads)
    contexts: dict[str, list[float]] = {"first try, right reply": [], "first try, greedy reply": []}
    contexts.update({name: [] for name in FEEDBACKS})
    examples = []
    for entry in negative_questions(args.every):
        opening = probe.opening(entry["question"])
        greedy = probe.greedy(opening)
        right = right_reply(greedy, str(entry["answer"]))
        stated = last_number(greedy) or greedy
        examples.append({"question": entry["question"], "greedy": greedy, "right": right})
        contexts["first try, right reply"].append(probe.probability(opening, right))
        contexts["first try, greedy reply"].append(probe.probability(opening, greedy))
        for name, feedback in FEEDBACKS.items():
            retry = opening + [{"role": "assistant", "content": greedy},
                               {"role": "user", "content": feedback.format(answer=stated)}]
            contexts[name].append(probe.probability(retry, right))
    figures = {name: summary(values) for name, values in contexts.items()}
    for name, figure in figures.items():
        print(f"{name:32s} P(right reply) mean {figure['mean']:.2e}  median {figure['median']:.2e}  n {figure['n']}"
              if "greedy" not in name else
              f"{name:32s} P(greedy reply) mean {figure['mean']:.2e}  median {figure['median']:.2e}  n {figure['n']}")
    print("greedy replies:", "; ".join(f"{e['question']} -> {e['greedy']!r}" for e in examples[:5]))
    right, greedy = figures["first try, right reply"]["mean"], figures["first try, greedy reply"]["mean"]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "headline": {"metric": "P(right reply) on negative-answer questions, first try, against the greedy reply's",
                         "unit": "probability", "value": right, "baseline": greedy,
                         "ratio": right / greedy if greedy else None},
            "model": args.model, "figures": figures, "examples": examples}, indent=2))


if __name__ == "__main__":
    main()
