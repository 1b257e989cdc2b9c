"""Flow-GRPO on the embedded digits model, with rollouts from the server's deployment handle.

    python examples/grpo_digits.py                      # starts Ray and the application itself
    ray job submit --working-dir . -- python examples/grpo_digits.py --app-name rollout
    python examples/grpo_digits.py --window-start 4 --sde-window 2 --branch      # tree rollouts
    python examples/grpo_digits.py --window-start 4 --sde-window 2 --compare-branch
    python examples/grpo_digits.py --algorithm branchgrpo                           # BranchGRPO's recipe
    python examples/grpo_digits.py --algorithm tempflow --group-size 3              # TempFlow-GRPO's

Each iteration:
1. rollouts: one request of `--prompts` digits x `--group-size` samples, stochastic on the
   `--sde-window` steps from `--window-start` of `--steps` steps (the others run as ODE), requiring
   the current weights. With `--branch`, each prompt's group is one tree (TempFlow-GRPO's fork):
   one trajectory up to the window's first step, where it branches into the group, each child
   drawing its own noise from there on; the transformer runs once for the shared prefix;
2. rewards, scored by the server as each part of the rollout is sampled (`rollout_reward_models`,
   the embedded model's scorers): ink, the mean pixel value of the image, is the reward (the
   classifier already scores 99% on the prompted digit, so it leaves no headroom); the
   classifier's probability of the prompted digit (`digits`) is logged as the guard against
   reward hacking, with the reward time the sampling hid;
3. advantages normalised within each prompt's group, by the server too (`rollout_advantages`);
4. clipped policy-gradient steps on the SDE window, the log-probs recomputed with autograd by
   `rollout.replay.transition_log_probs` from the returned latents and schedule (never
   rebuilt); the first step's ratio must be exactly 1;
5. the new weights to every replica: the LoRA adapter's tensors (default) or the full
   transformer (`--full-weights`), through the object store.
`--algorithm branchgrpo` is BranchGRPO's recipe instead (`train_branchgrpo_flux.py`, at the digits
model's 10 steps): one tree a prompt, DanceGRPO's SDE (eta 0.3) on every step, splits at steps
0, 3 and 6 (its 0, 3, 6, 9 of 20) into 2 children each, the children's noise scaled by
`--split-noise-scale` (its 4) with the nominal std in their log-probs; a node's reward is the mean
of its leaves', advantages are z-scored per depth over the tree, and every edge of the tree is
trained once (`rollout.replay.node_transition_log_probs`), not once per leaf below it.
`--algorithm tempflow` is TempFlow-GRPO's: one comb a prompt (`rollout_branch_shape: "comb"`), its
spine sampled by ODE, and at steps 0, 2, 4 and 6 (`--comb-branch-steps` of them) `--group-size`
children, each one Flow-GRPO SDE
step from the spine and an ODE tail; a step's children are a group (their rewards z-scored among
them), only their stochastic step is trained, and each step's loss is weighted by its noise std
over the mean of those of the steps trained (TempFlow-GRPO's noise-aware weighting, in that form).
Writes `metrics.jsonl` and `reward_curve.png` to `--output`; `--compare-branch` trains unbranched,
then branched, from the same start, and plots both rewards against wall time
(`reward_vs_wall_time.png`).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import ray
import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from deployments.client import get_or_deploy_app, push_weights
from rollout.models.digits import digit_prompt
from rollout.models.registry import load_pipeline
from rollout.replay import node_transition_log_probs, transition_log_probs
from rollout.sampler import request_noise_std
from rollout.trajectory import RolloutBatch, TreeNode

LORA_LAYERS = ["to_q", "to_k", "to_v", "to_out.0"]
ALGORITHMS = ("flow-grpo", "branchgrpo", "tempflow")
TITLES = {"flow-grpo": "Flow-GRPO", "branchgrpo": "BranchGRPO", "tempflow": "TempFlow-GRPO"}
# BranchGRPO's splits (0, 3, 6, 9 of 20 steps) at the digits model's 10: 2 x 2 x 2 = 8 leaves a root.
BRANCHGRPO_SPLITS = [0, 3, 6]
BRANCHGRPO_ETA = 0.3  # DanceGRPO's, which BranchGRPO keeps


@dataclass
class GRPOConfig:
    iterations: int = 20
    prompts: int = 8
    group_size: int = 8
    steps: int = 10
    sde_window: int = 4
    window_start: int = 0
    branch: bool = False
    noise_level: float = 0.7
    learning_rate: float = 3e-4
    clip_range: float = 1e-3
    minibatch: int = 16
    inner_epochs: int = 1
    lora_rank: int = 8
    full_weights: bool = False
    seed: int = 0
    algorithm: str = "flow-grpo"
    split_noise_scale: float = 4.0
    # TempFlow-GRPO's comb branches at every step; at the digits model's 10, every other step from
    # 0 (0, 2, 4, 6) keeps a root of 1 + 4 x group_size leaves within a worker's batch.
    comb_branch_steps: int = 4

    @property
    def comb_steps(self) -> list[int]:
        return list(range(0, 2 * self.comb_branch_steps, 2))


class Trainer:
    """The trainer's own copy of the model: a PEFT LoRA adapter on the transformer, or all of it."""

    def __init__(self, config: GRPOConfig):
        torch.manual_seed(config.seed)
        self.config = config
        self.pipeline = load_pipeline(device="cpu")
        transformer = self.pipeline.transformer
        if config.full_weights:
            parameters = list(transformer.parameters())
        else:
            lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_rank, target_modules=LORA_LAYERS)
            transformer.add_adapter(lora)  # B starts at 0: the adapter changes nothing yet
            parameters = [p for name, p in transformer.named_parameters() if "lora_" in name]
        for parameter in parameters:
            parameter.requires_grad_(True)
        transformer.train()
        self.optimizer = torch.optim.AdamW(parameters, lr=config.learning_rate)

    def weights(self) -> tuple[dict[str, torch.Tensor], dict]:
        """What to push: the adapter's tensors with its rank and alpha, or the full transformer."""
        transformer = self.pipeline.transformer
        if self.config.full_weights:
            return {k: v.detach().clone() for k, v in transformer.state_dict().items()}, {}
        rank = self.config.lora_rank
        return get_peft_model_state_dict(transformer), {"lora_rank": rank, "lora_alpha": rank}

    def step(self, batch, advantages: torch.Tensor, window: list[int]) -> dict:
        """Clipped policy-gradient steps on the rollout; the first step's max |new - old| log-prob."""
        config = self.config
        samples = batch.samples
        old = torch.stack([s.log_probs[window] for s in samples])  # (N, S), from the rollout
        first_step_error, steps = None, 0
        for _ in range(config.inner_epochs):
            order = torch.randperm(len(samples))
            for start in range(0, len(samples), config.minibatch):
                rows = order[start : start + config.minibatch].tolist()
                new = transition_log_probs(
                    self.pipeline, batch.schedule, batch.options, [samples[i] for i in rows], window
                )
                if first_step_error is None:
                    first_step_error = (new.detach() - old[rows]).abs().max().item()
                ratio = torch.exp(new - old[rows])
                advantage = advantages[rows].unsqueeze(1)
                clipped = ratio.clamp(1 - config.clip_range, 1 + config.clip_range)
                loss = torch.maximum(-advantage * ratio, -advantage * clipped).mean()
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
                steps += 1
        return {"first_step_max_abs_dlogp": first_step_error, "optimizer_steps": steps}

    def step_tree(self, batch: RolloutBatch, nodes: list[TreeNode], advantages: list[float]) -> dict:
        """BranchGRPO's update: clipped policy-gradient steps on every edge of the trees, each once,
        with its node's advantage, `--minibatch` leaves' worth of trees a step; the first step's
        max |new - old| log-prob."""
        config = self.config
        by_root: dict[int, list[int]] = {}
        for k, node in enumerate(nodes):
            by_root.setdefault(node.root, []).append(k)
        trees = list(by_root.values())
        trees_per_step = max(1, config.minibatch // len(nodes[trees[0][0]].leaves))
        first_step_error, steps = None, 0
        for _ in range(config.inner_epochs):
            order = torch.randperm(len(trees)).tolist()
            for start in range(0, len(trees), trees_per_step):
                chosen = [k for t in order[start : start + trees_per_step] for k in trees[t]]
                new = node_transition_log_probs(self.pipeline, batch, [nodes[k] for k in chosen])
                old = [nodes[k].tensors["log_probs"] for k in chosen]
                if first_step_error is None:
                    first_step_error = max((n.detach() - o).abs().max().item() for n, o in zip(new, old) if len(o))
                terms = []
                for node_new, node_old, k in zip(new, old, chosen):
                    ratio = torch.exp(node_new - node_old)
                    clipped = ratio.clamp(1 - config.clip_range, 1 + config.clip_range)
                    terms.append(torch.maximum(-advantages[k] * ratio, -advantages[k] * clipped))
                loss = torch.cat(terms).mean()
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
                steps += 1
        return {"first_step_max_abs_dlogp": first_step_error, "optimizer_steps": steps}


    def step_comb(self, batch: RolloutBatch, groups: dict[int, tuple[list[int], torch.Tensor]]) -> dict:
        """TempFlow-GRPO's update: for each branch step, a clipped policy-gradient step on the
        stochastic transition of its children (`groups`: step -> their batch indices and
        advantages), weighted by the step's noise std over the mean of the steps'; the first
        step's max |new - old| log-prob."""
        config, options = self.config, batch.options
        stds = {step: request_noise_std(options, batch.schedule.sigmas, step).item() for step in groups}
        first_step_error, steps = None, 0
        for _ in range(config.inner_epochs):
            for step, (leaves, advantages) in groups.items():
                samples = [batch.samples[i] for i in leaves]
                new = transition_log_probs(self.pipeline, batch.schedule, options, samples, [step])[:, 0]
                old = torch.stack([s.log_probs[step] for s in samples])
                if first_step_error is None:
                    first_step_error = (new.detach() - old).abs().max().item()
                ratio = torch.exp(new - old)
                clipped = ratio.clamp(1 - config.clip_range, 1 + config.clip_range)
                weight = stds[step] * len(stds) / sum(stds.values())
                loss = weight * torch.maximum(-advantages * ratio, -advantages * clipped).mean()
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
                steps += 1
        return {"first_step_max_abs_dlogp": first_step_error, "optimizer_steps": steps}


def per_depth_advantages(nodes: list[TreeNode], rewards: torch.Tensor) -> list[float]:
    """BranchGRPO's advantages: a node's reward is the mean of its leaves', z-scored among the nodes
    of its depth in its tree (cousins included); a depth of one node (the root) gets 0."""
    node_rewards = [rewards[list(node.leaves)].mean().item() for node in nodes]
    levels: dict[tuple[int, int], list[int]] = {}
    for k, node in enumerate(nodes):
        levels.setdefault((node.root, len(node.path)), []).append(k)
    advantages = [0.0] * len(nodes)
    for members in levels.values():
        values = torch.tensor([node_rewards[k] for k in members])
        if len(members) > 1:
            normalised = (values - values.mean()) / (values.std() + 1e-8)
            for k, value in zip(members, normalised.tolist()):
                advantages[k] = value
    return advantages


def sibling_groups(batch: RolloutBatch, rewards: torch.Tensor) -> dict[int, tuple[list[int], torch.Tensor]]:
    """TempFlow-GRPO's groups: the children a comb's spine grew at one branch step (the spine's
    own next node, child 0, is not one of them), their rewards z-scored among them (0 for a child
    alone); by step, over every prompt's comb, as batch indices and advantages."""
    nodes = batch.tree()
    groups: dict[int, tuple[list[int], list[float]]] = {}
    for node in nodes:
        children = [nodes[k] for k in node.children if nodes[k].path[-1] != 0]
        if not children:
            continue
        leaves = [child.leaves[0] for child in children]
        values = rewards[leaves]
        step_leaves, step_advantages = groups.setdefault(children[0].steps.start, ([], []))
        step_leaves += leaves
        alone = len(values) == 1  # a group of one child has nothing to be compared with
        step_advantages += [0.0] if alone else ((values - values.mean()) / (values.std() + 1e-8)).tolist()
    return {step: (leaves, torch.tensor(advantages)) for step, (leaves, advantages) in sorted(groups.items())}


def outputs_per_prompt(config: GRPOConfig) -> int:
    """A comb's leaves (its spine and `group_size` children at each branch step), else the group."""
    return 1 + config.group_size * len(config.comb_steps) if config.algorithm == "tempflow" else config.group_size


def rollout_fields(config: GRPOConfig, window: list[int]) -> dict:
    """The request's sampling fields for `config.algorithm`."""
    if config.algorithm == "tempflow":
        return {
            "rollout_noise_level": config.noise_level,
            "rollout_branch_shape": "comb",
            "rollout_branch_steps": config.comb_steps,
            "rollout_branch_factors": [config.group_size] * len(config.comb_steps),
            "rollout_return_dit_trajectory": True,
        }
    if config.algorithm == "branchgrpo":
        return {
            "rollout_sde_type": "dance",
            "rollout_noise_level": BRANCHGRPO_ETA,
            "rollout_branch_steps": BRANCHGRPO_SPLITS,
            "rollout_branch_factors": [2] * len(BRANCHGRPO_SPLITS),
            "rollout_branch_noise_scales": [config.split_noise_scale] * len(BRANCHGRPO_SPLITS),
            "rollout_branch_log_prob_std": "nominal",
            "rollout_return_dit_trajectory": True,  # every latent: every edge is trained
        }
    fields = {
        "rollout_noise_level": config.noise_level,
        "rollout_sde_step_indices": window,
        "rollout_return_step_indices": [*window, window[-1] + 1],  # x_i and x_(i+1) of each step trained
    }
    if config.branch:  # one root a prompt, forked into its group at the window's first step
        fields.update(rollout_branch_steps=[window[0]], rollout_branch_factors=[config.group_size])
    return fields


def train(handle, config: GRPOConfig, log=print) -> list[dict]:
    """Runs the loop against the application behind `handle`; one metrics dict per iteration."""
    trainer = Trainer(config)
    window = list(range(config.window_start, config.window_start + config.sde_window))
    version = "grpo-0"
    weights, lora_args = trainer.weights()
    push_weights(handle, weights, version, **lora_args)  # the server serves what the trainer holds
    history = []
    for iteration in range(config.iterations):
        started = time.perf_counter()
        digits = [(iteration * config.prompts + k) % 10 for k in range(config.prompts)]
        request = {
            "prompt": [digit_prompt(d) for d in digits],
            "num_outputs_per_prompt": outputs_per_prompt(config),
            "num_inference_steps": config.steps,
            "seed": config.seed + iteration * config.prompts * config.group_size,
            "rollout_debug_mode": False,
            "weight_version": version,
            "rollout_reward_models": ["ink", "digits"],
            "rollout_advantages": "group",
            **rollout_fields(config, window),
        }
        fetched = handle.generate.remote(request).result().fetch()
        batch = fetched.batch()
        rollout_s = time.perf_counter() - started

        rewards = torch.tensor([s.rewards["ink"] for s in batch.samples])
        advantages = torch.tensor([s.advantages["ink"] for s in batch.samples])
        digit_probability = sum(s.rewards["digits"] for s in batch.samples) / len(batch.samples)

        started = time.perf_counter()
        if config.algorithm == "branchgrpo":
            nodes = batch.tree()
            update = trainer.step_tree(batch, nodes, per_depth_advantages(nodes, rewards))
            update["transitions_trained"] = sum(len(node.steps) for node in nodes)  # each edge once
        elif config.algorithm == "tempflow":
            groups = sibling_groups(batch, rewards)
            update = trainer.step_comb(batch, groups)
            update["transitions_trained"] = sum(len(leaves) for leaves, _ in groups.values())
            spines = [k for k, s in enumerate(batch.samples) if not any(s.branch_path)]
            update["spine_reward"] = round(rewards[spines].mean().item(), 4)  # the ODE sample's, what the policy makes
        else:
            update = trainer.step(batch, advantages, window)
        train_s = time.perf_counter() - started

        started = time.perf_counter()
        version = f"grpo-{iteration + 1}"
        weights, lora_args = trainer.weights()
        push_weights(handle, weights, version, **lora_args)
        sync_s = time.perf_counter() - started

        metrics = {
            "iteration": iteration,
            "reward": round(rewards.mean().item(), 4),
            "digit_probability": round(digit_probability, 4),
            **update,
            "rollout_weight_version": batch.samples[0].weight_version,
            "rollout_s": round(rollout_s, 2),
            # Scoring that ran while parts were still being sampled cost the loop nothing.
            "reward_s": round(fetched.reward_times.reward_time_s, 3),
            "reward_hidden_s": round(fetched.reward_times.reward_time_s - fetched.reward_times.reward_wait_s, 3),
            "train_s": round(train_s, 2),
            "sync_s": round(sync_s, 2),
        }
        history.append(metrics)
        log(json.dumps(metrics))
    return history


def plot(history: list[dict], path: Path, title: str = "Flow-GRPO") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    iterations = [m["iteration"] for m in history]
    figure, reward_axis = plt.subplots(figsize=(6, 3.5))
    reward_axis.plot(iterations, [m["reward"] for m in history], color="tab:blue", label="reward (ink)")
    reward_axis.set_xlabel("iteration")
    reward_axis.set_ylabel("mean reward (ink)", color="tab:blue")
    guard_axis = reward_axis.twinx()
    guard_axis.plot(iterations, [m["digit_probability"] for m in history], color="tab:orange")
    guard_axis.set_ylabel("classifier's probability of the digit", color="tab:orange")
    guard_axis.set_ylim(0, 1.05)
    guard_axis.axhline(0.9, color="tab:orange", linestyle=":", linewidth=1)
    figure.suptitle(f"{title} on the embedded digits model")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_against_wall_time(histories: dict[str, list[dict]], path: Path) -> None:
    """Each run's mean reward against its own elapsed time (rollout, training and weight sync)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5))
    for label, history in histories.items():
        elapsed, seconds = [], 0.0
        for m in history:
            seconds += m["rollout_s"] + m["train_s"] + m["sync_s"]
            elapsed.append(seconds)
        axis.plot(elapsed, [m["reward"] for m in history], marker=".", label=label)
    axis.set_xlabel("wall time (s): rollout + training + weight sync")
    axis.set_ylabel("mean reward (ink)")
    axis.legend()
    figure.suptitle("Flow-GRPO on the digits model: tree rollouts against unbranched")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    defaults = GRPOConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, value in vars(defaults).items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, bool):
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=type(value), default=value)
    parser.add_argument("--app-name", default="rollout", help="the application to use, deployed if not running")
    parser.add_argument("--output", type=Path, default=Path("outputs/grpo"))
    parser.add_argument("--compare-branch", action="store_true", help="train unbranched, then with --branch")
    args = vars(parser.parse_args(argv))
    app_name, output, compare = args.pop("app_name"), args.pop("output"), args.pop("compare_branch")
    config = GRPOConfig(**args)
    if config.algorithm not in ALGORITHMS:
        parser.error(f"--algorithm must be one of {list(ALGORITHMS)}, got {config.algorithm!r}")
    if config.algorithm == "branchgrpo" and config.group_size != 2 ** len(BRANCHGRPO_SPLITS):
        parser.error(f"--algorithm branchgrpo grows one tree of {2 ** len(BRANCHGRPO_SPLITS)} leaves a prompt: --group-size must be that")

    ray.init(log_to_driver=False)  # in a job: the cluster's; run as a script: a new local one
    handle = get_or_deploy_app(app_name, {"worker_torch_threads": 1})
    runs = {"unbranched": replace(config, branch=False), "branched": replace(config, branch=True)} if compare else {"": config}
    histories = {}
    for label, run_config in runs.items():
        run_output = output / label
        run_output.mkdir(parents=True, exist_ok=True)
        with open(run_output / "metrics.jsonl", "w") as metrics:
            log = lambda line: (print(line, flush=True), metrics.write(line + "\n"))  # noqa: E731
            histories[label] = history = train(handle, run_config, log=log)
        plot(history, run_output / "reward_curve.png", TITLES[config.algorithm])
        print(f"{label or 'run'}: reward {history[0]['reward']} -> {history[-1]['reward']}; curve in {run_output / 'reward_curve.png'}")
    if compare:
        plot_against_wall_time(histories, output / "reward_vs_wall_time.png")
        print(f"both against wall time: {output / 'reward_vs_wall_time.png'}")


if __name__ == "__main__":
    main()
