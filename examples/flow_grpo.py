"""Flow-GRPO on an SD3-family model, through the typed client: a trainer that needs no Ray.

    python -m deployments serve --config deployments/serve_config_rewards.yaml --model /models/sd3.5-medium
    python examples/flow_grpo.py --model /models/sd3.5-medium --url http://127.0.0.1:8000

`--model` is the trainer's own copy of the served model (the same diffusers directory); the server
at `--url` samples and scores. Each iteration, as Flow-GRPO's `train_sd3.py` does:
1. rollouts: `--prompts-per-iteration` prompts x `--group-size` samples, stochastic on every step
   of `--steps` (Flow-GRPO's SDE), requiring the weights the trainer last pushed; the server scores
   each part as it is sampled (`--scorer`, one of its `rollout_reward_models`) and normalises the
   rewards within each prompt's group (`rollout_advantages`);
2. a clipped policy-gradient loss on every step, its log-probs recomputed with autograd by the
   library's differentiable replay (`rollout.replay.replayed_transitions`) from the returned
   latents, schedule and conditioning, never rebuilt; the first replay of each iteration is
   on-policy, so its per-step |new - old| log-prob is exactly 0, and the run stops if it is not;
3. the KL to the reference model (the base weights: the adapter disabled), Flow-GRPO's
   squared distance of the two models' transition means over twice the step's variance, times `--beta`;
4. the PEFT LoRA adapter's tensors pushed to every replica (`update_weights_from_tensor`), as the
   next weight version.
Writes one JSON line of metrics per iteration to `--output`/metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from rollout.client import RolloutClient
from rollout.micro_batching import MicroBatching
from rollout.models.registry import load_pipeline
from rollout.replay import replayed_transitions
from rollout.trajectory import RolloutBatch

# Flow-GRPO's SD3 adapter: the attention projections of every block.
LORA_LAYERS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
PROMPTS = (
    "a photo of a red apple on a wooden table",
    "a watercolor painting of a lighthouse in a storm",
    "an astronaut riding a horse on the moon",
    "a bowl of ramen, studio lighting",
)


@dataclass
class FlowGRPOConfig:
    iterations: int = 100
    prompts_per_iteration: int = 2
    group_size: int = 8
    steps: int = 10
    height: int = 0  # 0: the model's default
    width: int = 0
    guidance_scale: float = 4.5
    noise_level: float = 0.7
    scorer: str = "pickscore"
    learning_rate: float = 3e-4
    clip_range: float = 1e-4
    advantage_clip: float = 5.0
    beta: float = 0.04
    minibatch: int = 8
    lora_rank: int = 32
    lora_alpha: float = 64.0
    seed: int = 0


class Trainer:
    """The trainer's copy of the served model with a PEFT LoRA adapter on its transformer, loaded as
    the server runs it (dtype, attention kernel and micro-batch sizes from `/rollout/info`), so
    that its replay of a rollout is the rollout's own computation."""

    def __init__(self, config: FlowGRPOConfig, model: str, info: dict, device: str):
        torch.manual_seed(config.seed)
        self.config = config
        self.pipeline = load_pipeline(
            None,
            model,
            device=device,
            dtype=getattr(torch, info["dtype"]),
            micro_batching=MicroBatching.parse(**info["micro_batching"]),
            attention_backend=info["attention_backend"],
        )
        transformer = self.pipeline.transformer
        transformer.add_adapter(LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, target_modules=LORA_LAYERS))
        self.parameters = [p for name, p in transformer.named_parameters() if "lora_" in name]
        # B starts at 0: the adapter changes nothing yet. Its dtype is the model's, as the replicas
        # hold it: an fp32 adapter here against a bf16 one there would not replay exactly.
        for parameter in self.parameters:
            parameter.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(self.parameters, lr=config.learning_rate)

    def adapter(self) -> dict[str, torch.Tensor]:
        return get_peft_model_state_dict(self.pipeline.transformer)

    def step(self, batch: RolloutBatch, advantages: torch.Tensor) -> dict:
        """One pass of clipped policy-gradient steps over the batch, step by step of the trajectory
        (gradients accumulated over the steps of a minibatch, as Flow-GRPO trains)."""
        config, samples = self.config, batch.samples
        steps = [step for step in range(batch.options.num_inference_steps) if batch.options.transition_at(step).draws_noise]
        old = torch.stack([s.log_probs[steps] for s in samples])  # (N, S), as the rollout sampled them
        advantages = advantages.clamp(-config.advantage_clip, config.advantage_clip)
        first_dlogp: list[float] | None = None
        totals = {"policy_loss": 0.0, "kl": 0.0, "clip_fraction": 0.0}
        terms = 0
        order = torch.randperm(len(samples))
        transformer = self.pipeline.transformer
        for start in range(0, len(samples), config.minibatch):
            rows = order[start : start + config.minibatch].tolist()
            chosen = [samples[i] for i in rows]
            dlogp = []
            for k, step in enumerate(steps):
                new = replayed_transitions(self.pipeline, batch.schedule, batch.options, chosen, [step])
                dlogp.append((new.log_probs.detach()[:, 0] - old[rows, k]).abs().max().item())
                ratio = torch.exp(new.log_probs[:, 0] - old[rows, k])
                advantage = advantages[rows]
                clipped = ratio.clamp(1 - config.clip_range, 1 + config.clip_range)
                policy_loss = torch.maximum(-advantage * ratio, -advantage * clipped).mean()
                loss = policy_loss
                kl = torch.zeros(())
                if config.beta > 0:
                    with torch.no_grad():
                        transformer.disable_adapters()
                        try:
                            reference = replayed_transitions(self.pipeline, batch.schedule, batch.options, chosen, [step])
                        finally:
                            transformer.enable_adapters()
                    distance = (new.means[:, 0] - reference.means[:, 0]).pow(2)
                    kl = (distance.flatten(1).mean(1) / (2 * new.noise_stds[0] ** 2)).mean()
                    loss = loss + config.beta * kl
                (loss / len(steps)).backward()
                totals["policy_loss"] += policy_loss.item()
                totals["kl"] += kl.item()
                totals["clip_fraction"] += ((ratio - 1).abs() > config.clip_range).float().mean().item()
                terms += 1
            if first_dlogp is None:
                first_dlogp = dlogp
            torch.nn.utils.clip_grad_norm_(self.parameters, 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad()
        return {"first_replay_abs_dlogp_per_step": first_dlogp, **{name: total / terms for name, total in totals.items()}}


def train(client: RolloutClient, trainer: Trainer, config: FlowGRPOConfig, prompts: list[str], log=print) -> list[dict]:
    """Runs the loop against the server behind `client`; one metrics dict per iteration."""
    version = "flow-grpo-0"
    rank, alpha = config.lora_rank, config.lora_alpha
    client.update_weights_from_tensor(trainer.adapter(), version, lora_rank=rank, lora_alpha=alpha)
    history = []
    for iteration in range(config.iterations):
        started = time.perf_counter()
        chosen = [prompts[(iteration * config.prompts_per_iteration + k) % len(prompts)] for k in range(config.prompts_per_iteration)]
        request = {
            "prompt": chosen,
            "num_outputs_per_prompt": config.group_size,
            "num_inference_steps": config.steps,
            "guidance_scale": config.guidance_scale,
            "seed": config.seed + iteration * len(chosen) * config.group_size,
            "rollout_noise_level": config.noise_level,
            "rollout_return_dit_trajectory": True,  # the latents x_0 .. x_T that replay scores
            "rollout_return_denoising_env": True,  # and the conditioning it ran on
            "rollout_debug_mode": False,
            "weight_version": version,
            "rollout_reward_models": [config.scorer],
            "rollout_advantages": "group",
            **({"height": config.height} if config.height else {}),
            **({"width": config.width} if config.width else {}),
        }
        answer = client.generate_answer(request)
        batch = answer.batch
        rollout_s = time.perf_counter() - started
        rewards = torch.tensor([s.rewards[config.scorer] for s in batch.samples])
        advantages = torch.tensor([s.advantages[config.scorer] for s in batch.samples])

        started = time.perf_counter()
        update = trainer.step(batch, advantages)
        train_s = time.perf_counter() - started
        if any(dlogp != 0 for dlogp in update["first_replay_abs_dlogp_per_step"]):
            raise RuntimeError(f"the on-policy replay is off the rollout: |dlogp| {update['first_replay_abs_dlogp_per_step']}")

        started = time.perf_counter()
        version = f"flow-grpo-{iteration + 1}"
        client.update_weights_from_tensor(trainer.adapter(), version, lora_rank=rank, lora_alpha=alpha)
        sync_s = time.perf_counter() - started

        metrics = {
            "iteration": iteration,
            "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
            **update,
            "rollout_weight_version": batch.samples[0].weight_version,
            "rollout_s": round(rollout_s, 3),
            "reward_hidden_s": round((answer.reward_time_s or 0) - (answer.reward_wait_s or 0), 3),
            "train_s": round(train_s, 3),
            "sync_s": round(sync_s, 3),
        }
        history.append(metrics)
        log(json.dumps(metrics))
    return history


def main(argv: list[str] | None = None) -> list[dict]:
    defaults = FlowGRPOConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the trainer's copy of the served diffusers directory")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the rollout server")
    parser.add_argument("--token", default=os.environ.get("ROLLOUT_AUTH_TOKEN"), help="its auth_token (ROLLOUT_AUTH_TOKEN)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=Path, help="a file of prompts, one a line (default: a few of Flow-GRPO's kind)")
    parser.add_argument("--output", type=Path, default=Path("outputs/flow_grpo"))
    for name, value in vars(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    model, url, token, device = args.pop("model"), args.pop("url"), args.pop("token"), args.pop("device")
    prompts_file, output = args.pop("prompts"), args.pop("output")
    config = FlowGRPOConfig(**args)
    prompts = prompts_file.read_text().split("\n") if prompts_file else list(PROMPTS)
    prompts = [prompt for prompt in prompts if prompt.strip()]

    client = RolloutClient(url, token)
    trainer = Trainer(config, model, client.info(), device)
    output.mkdir(parents=True, exist_ok=True)
    with open(output / "metrics.jsonl", "w") as metrics:
        log = lambda line: (print(line, flush=True), metrics.write(line + "\n"))  # noqa: E731
        history = train(client, trainer, config, prompts, log=log)
    print(f"reward {history[0]['reward_mean']:.4f} -> {history[-1]['reward_mean']:.4f}; metrics in {output / 'metrics.jsonl'}")
    return history


if __name__ == "__main__":
    main()
