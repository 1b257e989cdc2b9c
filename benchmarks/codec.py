"""The wire codec against a plain copy of the same number of bytes.

Two response bodies, encoded with `to_msgpack` and decoded with `from_msgpack`:
- real-size rows: 8 samples of a 512x512 image, 11 latents and 10-step debug tensors of
  16x64x64 fp32 (about 111 MB), shaped like an SD3.5 or FLUX.1 response;
- a heavy digits response: 16 samples of the embedded model, 20 steps, with the trajectory,
  debug tensors and `denoising_env` (about 1.4 MB), built by the library's own `response_rows`;
- the same samples as the batch answer (`rollout.rows.batch_answer`, what `rollout.client` asks
  for), decoded back to a `RolloutBatch` (`from_msgpack`, then `RolloutBatch.from_wire`).

Each figure is the best of several runs divided by the best time of `torch.clone` of a uint8
tensor as large as the body.

    .venv/bin/python -m benchmarks.codec
"""

from __future__ import annotations

import timeit
from collections.abc import Callable
from typing import Any

import torch

from rollout.codec import from_msgpack, to_msgpack
from rollout.models.registry import load_pipeline
from rollout.plan import RequestLimits, RolloutPlan, plan_rollout
from rollout.rows import batch_answer, response_rows
from rollout.sampler import sample
from rollout.schema import RolloutRequest
from rollout.trajectory import RolloutBatch


def real_size_rows() -> list[dict]:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(shape, generator=generator)

    steps, schedule = 10, torch.linspace(1, 0, 11)
    return [
        {
            "generated_output": torch.rand((3, 512, 512), generator=generator),
            "rollout_log_probs": randn(steps),
            "rollout_debug_tensors": {
                "rollout_variance_noises": randn(steps, 16, 64, 64),
                "rollout_prev_sample_means": randn(steps, 16, 64, 64),
                "rollout_noise_std_devs": randn(steps, 1),
                "rollout_model_outputs": randn(steps, 16, 64, 64),
            },
            "dit_trajectory": {"latents": randn(steps + 1, 16, 64, 64), "sigmas": schedule},
        }
        for _ in range(8)
    ]


def _digits_plan_and_batch() -> tuple[RolloutPlan, RolloutBatch]:
    request = RolloutRequest(
        prompt=["3", "7"],
        num_outputs_per_prompt=8,
        num_inference_steps=20,
        seed=0,
        rollout_debug_mode=True,
        rollout_return_dit_trajectory=True,
        rollout_return_denoising_env=True,
    )
    plan = plan_rollout(request, RequestLimits())
    prompts = [p for p in request.prompts() for _ in range(plan.num_outputs_per_prompt)]
    batch = sample(load_pipeline(device="cpu"), prompts, [plan.seed + i for i in range(len(prompts))], plan.options)
    return plan, batch


def digits_rows() -> list[dict]:
    return response_rows(*_digits_plan_and_batch(), inference_time_s=0.0)


def digits_batch_answer() -> dict:
    return batch_answer(*_digits_plan_and_batch(), inference_time_s=0.0)


def batch_of_answer(body: bytes) -> RolloutBatch:
    """What `rollout.client` makes of a batch answer's body."""
    return RolloutBatch.from_wire(from_msgpack(body)["batch"])


def ratios(rows: list[dict] | dict, repeat: int = 7, decode: Callable[[bytes], Any] = from_msgpack) -> dict[str, float]:
    body = to_msgpack(rows)
    plain = torch.empty(len(body), dtype=torch.uint8)

    def best(fn, number: int) -> float:
        return min(timeit.repeat(fn, number=number, repeat=repeat)) / number

    number = 1 if len(body) > 10_000_000 else 20
    copy = best(plain.clone, number * 10)
    return {
        "bytes": len(body),
        "encode_over_copy": best(lambda: to_msgpack(rows), number) / copy,
        "decode_over_copy": best(lambda: decode(body), number) / copy,
        "encode_s": best(lambda: to_msgpack(rows), number),
        "decode_s": best(lambda: decode(body), number),
    }


def main() -> None:
    print("| body | MB | to_msgpack / copy | from_msgpack / copy |")
    print("|---|---|---|---|")
    bodies = (
        ("real-size, 8 samples", real_size_rows(), from_msgpack),
        ("digits, 16 samples, heavy", digits_rows(), from_msgpack),
        ("the same, as the batch answer", digits_batch_answer(), batch_of_answer),
    )
    for name, rows, decode in bodies:
        figures = ratios(rows, decode=decode)
        print(
            f"| {name} | {figures['bytes'] / 1e6:.1f} | {figures['encode_over_copy']:.1f}x "
            f"| {figures['decode_over_copy']:.1f}x |"
        )


if __name__ == "__main__":
    main()
