"""Trains the embedded digits model: a class-conditional rectified-flow transformer.

Run from the repository root::

    python -m training.train_digit_flow                  # writes the packaged weights

Data: all 1797 scikit-learn digits at 16x16 (`training.digits_data`), as latents in [-1, 1].
Only the classifier needs a held-out split (it judges the samples); the generative model uses
every digit there is.

Objective (rectified flow, the convention of diffusers' `FlowMatchEulerDiscreteScheduler`): for a
clean latent ``x0``, noise ``eps`` and a noise level ``sigma`` drawn from a logit-normal
distribution, the model sees ``x_t = (1 - sigma) * x0 + sigma * eps`` at ``timestep = 1000 * sigma``
and regresses the velocity ``v = eps - x0`` (so Euler steps ``x += (sigma_next - sigma) * v``
walk from noise to data). The prompt embeddings (`DigitPromptEncoder`) train jointly; 10% of
labels are replaced by `UNCONDITIONAL_CLASS`, the empty prompt, so classifier-free guidance
works. AdamW with warm-up and cosine decay; an exponential moving average of the weights is
what gets saved (in fp16). Seeded, CPU only.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import FlowMatchEulerDiscreteScheduler

from rollout.models.digits import (
    DEFAULT_WEIGHTS,
    UNCONDITIONAL_CLASS,
    DigitFlowPipeline,
    DigitPromptEncoder,
    images_to_latents,
    tiny_transformer,
)
from training.digits_data import load_digit_images

NUM_TRAIN_TIMESTEPS = 1000  # FlowMatchEulerDiscreteScheduler's default: timestep = sigma * 1000


class FlowModel(torch.nn.Module):
    """The trainable pair: prompt encoder and transformer, predicting the velocity."""

    def __init__(self):
        super().__init__()
        self.prompt_encoder = DigitPromptEncoder()
        self.transformer = tiny_transformer(self.prompt_encoder)

    def forward(self, x_t: torch.Tensor, sigma: torch.Tensor, class_ids: torch.Tensor) -> torch.Tensor:
        prompt_embeds, pooled = self.prompt_encoder(class_ids)
        return self.transformer(
            hidden_states=x_t,
            encoder_hidden_states=prompt_embeds,
            pooled_projections=pooled,
            timestep=sigma * NUM_TRAIN_TIMESTEPS,
            return_dict=False,
        )[0]


def sample_sigmas(batch_size: int, generator: torch.Generator, logit_mean: float, logit_std: float) -> torch.Tensor:
    """Noise levels in (0, 1), shape `(B,)`: ``sigmoid(N(logit_mean, logit_std))`` (SD3's logit-normal)."""
    return torch.sigmoid(torch.randn(batch_size, generator=generator) * logit_std + logit_mean)


def flow_matching_loss(
    model: FlowModel,
    latents: torch.Tensor,
    labels: torch.Tensor,
    generator: torch.Generator,
    label_dropout: float,
    logit_mean: float,
    logit_std: float,
) -> torch.Tensor:
    """Mean squared velocity error on a batch of clean `latents` `(B, 1, H, W)` with `labels` `(B,)`."""
    b = latents.shape[0]
    sigma = sample_sigmas(b, generator, logit_mean, logit_std)
    noise = torch.randn(latents.shape, generator=generator)
    s = sigma.view(b, 1, 1, 1)
    x_t = (1 - s) * latents + s * noise
    drop = torch.rand(b, generator=generator) < label_dropout
    class_ids = torch.where(drop, torch.full_like(labels, UNCONDITIONAL_CLASS), labels)
    return F.mse_loss(model(x_t, sigma, class_ids), noise - latents)


def learning_rate(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(args: argparse.Namespace) -> FlowModel:
    """Returns the EMA model after `args.steps` optimiser steps."""
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    images, labels = load_digit_images()
    latents = images_to_latents(images)
    model = FlowModel().train()
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.99))
    print(
        f"{len(latents)} digits, {sum(p.numel() for p in model.parameters())} parameters, "
        f"{args.steps} steps of batch {args.batch_size}",
        flush=True,
    )
    start = time.perf_counter()
    running = 0.0
    order, cursor = torch.randperm(len(latents), generator=generator), 0
    for step in range(args.steps):
        if cursor + args.batch_size > len(order):
            order, cursor = torch.randperm(len(latents), generator=generator), 0
        batch = order[cursor : cursor + args.batch_size]
        cursor += args.batch_size
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
        loss = flow_matching_loss(
            model, latents[batch], labels[batch], generator, args.label_dropout, args.logit_mean, args.logit_std
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        # EMA with a warm-up so the early average is not dominated by the random initialisation.
        decay = min(args.ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            for p_ema, p in zip(ema.parameters(), model.parameters()):
                p_ema.lerp_(p, 1 - decay)
        running += loss.item()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            elapsed = time.perf_counter() - start
            print(
                f"step {step + 1:5d}  loss {running / args.log_every:.4f}  "
                f"lr {optimizer.param_groups[0]['lr']:.2e}  {elapsed:.0f} s",
                flush=True,
            )
            running = 0.0
    return ema


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_WEIGHTS, help="pipeline folder to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--ema-decay", type=float, default=0.999)
    parser.add_argument("--label-dropout", type=float, default=0.1)
    parser.add_argument("--logit-mean", type=float, default=0.0, help="mean of the logit-normal sigma distribution")
    parser.add_argument("--logit-std", type=float, default=1.0, help="std of the logit-normal sigma distribution")
    parser.add_argument("--shift", type=float, default=1.0, help="the saved scheduler's sigma shift (sampling only)")
    parser.add_argument("--guidance-scale", type=float, default=2.0, help="the pipeline's default guidance scale")
    parser.add_argument("--log-every", type=int, default=100)
    args = parser.parse_args()

    start = time.perf_counter()
    ema = train(args)
    pipeline = DigitFlowPipeline(
        ema.transformer,
        ema.prompt_encoder,
        FlowMatchEulerDiscreteScheduler(num_train_timesteps=NUM_TRAIN_TIMESTEPS, shift=args.shift),
        default_guidance_scale=args.guidance_scale,
    )
    pipeline.save_pretrained(args.output)
    size = sum(f.stat().st_size for f in args.output.rglob("*") if f.is_file())
    print(f"saved {args.output} ({size} bytes) in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
