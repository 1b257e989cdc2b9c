"""The response rows: one map per sample, in SGLang's layout, from a plan and its sampled batch;
for a trainer that reads rows, the schedule they carry; and the batch answer, for a client that
reads the batch itself (`rollout.client`): `RolloutBatch.to_wire` beside the request's own fields.

Every row has all of SGLang's keys (None where unset), then this server's extensions. Tensors
are left for the codec (`rollout.codec`) to encode; the per-request tensors of `dit_trajectory`
are one object each, shared by every row, so a `TensorEncoder` encodes them once per response.
"""

from __future__ import annotations

from typing import Any

import torch

from rollout.cost import RequestCost, TransformerCost
from rollout.errors import InvalidRequestError
from rollout.plan import RolloutPlan
from rollout.schedule import ScheduleSnapshot
from rollout.trajectory import RolloutBatch, SampleTrajectory
from rollout.video import frames_as_uint8

# `dit_trajectory` key -> the `ScheduleSnapshot` field it holds, whole and unfiltered.
SCHEDULE_KEYS = {"sigmas": "sigmas", "scheduler_timesteps": "timesteps", "model_timesteps": "model_timesteps"}
# Held only by a model with several denoisers (`ScheduleSnapshot.model_experts`).
EXPERTS_KEY = "model_experts"
# The `Accept` media types of the batch answer (`batch_answer`), by the codec that writes each.
BATCH_MSGPACK = "application/vnd.rollout.batch+msgpack"
BATCH_JSON = "application/vnd.rollout.batch+json"


def response_rows(
    plan: RolloutPlan,
    batch: RolloutBatch,
    inference_time_s: float,
    peak_memory_mb: float | None = None,
    reward_times: tuple[float, float] | None = None,
    cost: TransformerCost | None = None,
    request_cost: RequestCost | None = None,
) -> list[dict[str, Any]]:
    """One map per sample (a tree's leaf), in request order: SGLang's keys, `inference_time_s`
    the whole request's wall time (the same in every row), then the extensions
    `prompt_index`, `sample_seed`, `weight_version`, `branch_path` (the leaf's child index at each
    branch step; [] unbranched), `branch_seeds` (the seeds of the generators its noise came from,
    root first: `rollout.tree`), `transformer_rows` and `transformer_rows_unbranched` (`cost`: the
    whole request's, the same in every row as `inference_time_s` is; None where not given:
    `rollout.cost`), `request_cost` (`request_cost`: what the request was admitted as, in token-steps,
    the same in every row; None where not given); with `rollout_reward_models`, `rewards` {scorer: score},
    `reward_time_s` and `reward_wait_s` (`reward_times`: the request's scoring time, and the part of
    it after sampling) and, with `rollout_advantages`, `advantages` {scorer: advantage}."""
    request = plan.request
    kept_steps = torch.tensor(batch.options.kept_latent_steps(), dtype=torch.int64)
    trajectory_labels = {
        "timesteps": batch.schedule.latent_timesteps(kept_steps),  # one per returned latent, SGLang's runtime
        # sigmas [T + 1], the scheduler's timesteps [T], the transformer's time input [T]: whole, never filtered
        **{key: getattr(batch.schedule, field) for key, field in SCHEDULE_KEYS.items()},
        "latent_step_indices": kept_steps,
    }
    if batch.schedule.model_experts is not None:
        trajectory_labels[EXPERTS_KEY] = batch.schedule.model_experts
    return_trajectory = request.rollout and request.rollout_return_dit_trajectory
    per_request = request_fields(plan, inference_time_s, peak_memory_mb, reward_times, cost, request_cost)
    return [
        {
            "request_id": plan.request_id,
            "prompt": sample.prompt,
            "seed": plan.seed,
            "generated_output": _generated_output(sample.image, request.rollout_video_dtype),
            "rollout_log_probs": sample.log_probs if request.rollout else None,
            "rollout_debug_tensors": _debug_tensors(sample),
            "denoising_env": sample.denoising_env,
            "dit_trajectory": {"latents": sample.latents, **trajectory_labels} if return_trajectory else None,
            "inference_time_s": per_request["inference_time_s"],
            "peak_memory_mb": per_request["peak_memory_mb"],
            "prompt_index": i // plan.num_outputs_per_prompt,
            "sample_seed": sample.seed,
            "weight_version": sample.weight_version,
            "branch_path": list(sample.branch_path),
            "branch_seeds": list(sample.branching.branch_seeds(sample.root_seed, sample.branch_path)),
            **{name: per_request[name] for name in ("transformer_rows", "transformer_rows_unbranched", "request_cost")},
            **_reward_fields(plan, sample, per_request),
        }
        for i, sample in enumerate(batch.samples)
    ]


def request_fields(
    plan: RolloutPlan,
    inference_time_s: float,
    peak_memory_mb: float | None = None,
    reward_times: tuple[float, float] | None = None,
    cost: TransformerCost | None = None,
    request_cost: RequestCost | None = None,
) -> dict[str, Any]:
    """What a response says of the whole request (`response_rows` repeats it in every row):
    `request_id`, `inference_time_s`, `peak_memory_mb`, `transformer_rows`,
    `transformer_rows_unbranched`, `request_cost`, and with rewards `reward_time_s`, `reward_wait_s`."""
    fields = {
        "request_id": plan.request_id,
        "inference_time_s": inference_time_s,
        "peak_memory_mb": None if plan.request.suppress_logs else peak_memory_mb,
        "transformer_rows": None if cost is None else cost.transformer_rows,
        "transformer_rows_unbranched": None if cost is None else cost.transformer_rows_unbranched,
        "request_cost": None if request_cost is None else request_cost.token_steps,
    }
    if plan.rewards is not None:
        fields["reward_time_s"], fields["reward_wait_s"] = reward_times or (None, None)
    return fields


def batch_answer(plan: RolloutPlan, batch: RolloutBatch, **request: Any) -> dict[str, Any]:
    """The batch answer: `request_fields(plan, **request)` and the batch itself, under `batch`
    (`RolloutBatch.to_wire`: the schedule once, a tree's nodes once, every tensor as sampled)."""
    return {**request_fields(plan, **request), "batch": batch.to_wire()}


def _reward_fields(plan: RolloutPlan, sample: SampleTrajectory, per_request: dict[str, Any]) -> dict[str, Any]:
    if plan.rewards is None:
        return {}
    fields = {"rewards": sample.rewards, "reward_time_s": per_request["reward_time_s"], "reward_wait_s": per_request["reward_wait_s"]}
    if plan.rewards.group_advantages:
        fields["advantages"] = sample.advantages
    return fields


def _generated_output(output: torch.Tensor, video_dtype: str | None) -> torch.Tensor:
    """A sample's image, or its video's frames (`[3, F, H, W]`) rounded to uint8 when asked."""
    if video_dtype == "uint8" and output.ndim == 4:
        return frames_as_uint8(output)
    return output


def _debug_tensors(sample: SampleTrajectory) -> dict[str, torch.Tensor] | None:
    if sample.debug is None:
        return None
    return {
        "rollout_variance_noises": sample.debug.variance_noises,
        "rollout_prev_sample_means": sample.debug.prev_sample_means,
        "rollout_noise_std_devs": sample.debug.noise_std_devs.unsqueeze(-1),  # [T, 1], as SGLang's
        "rollout_model_outputs": sample.debug.model_outputs,
    }



def schedule_of_row(row: dict[str, Any]) -> ScheduleSnapshot:
    """The schedule a row's `dit_trajectory` carries, from its three tensors as they came (and a
    two-expert model's `model_experts`; a trainer reading rows replays with it); raises `InvalidRequestError` if any is missing, since a guessed
    one (`model_timesteps` from `timesteps`, sigmas from `timesteps / 1000`) breaks the replay."""
    trajectory = row.get("dit_trajectory")
    if trajectory is None:
        raise InvalidRequestError("dit_trajectory", "the row has none: ask for it with rollout_return_dit_trajectory")
    missing = [key for key in SCHEDULE_KEYS if key not in trajectory]
    if missing:
        raise InvalidRequestError("dit_trajectory", f"lacks {missing}: the schedule cannot be taken from it")
    experts = {"model_experts": trajectory[EXPERTS_KEY]} if EXPERTS_KEY in trajectory else {}
    return ScheduleSnapshot(**{field: trajectory[key] for key, field in SCHEDULE_KEYS.items()}, **experts)
