"""One denoising transition x_t -> x_next of a flow-matching sampler, with its log-probability.

The same function samples (given standard-normal noise) and scores (given the x_next that was
taken), so a trainer replays a rollout with exactly the code that produced it. Everything is
computed in fp32 whatever the model dtype: the log-density of a small-variance Gaussian is
dominated by (x_next - mean)^2 / std^2, which bf16 cannot resolve.

Notation: sigma = sigmas[i], sigma_next = sigmas[i + 1], dt = sigma_next - sigma (< 0), v is the
model's velocity (after guidance), eta the noise level.

A video model may hold its first latent frames at given values at every step instead of sampling
them (`HeldFrames`: Wan2.2-TI2V-5B conditioned on an image); the step replaces them in x_next, and
the log-prob is the mean over the elements it sampled.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


class TransitionKind(str, enum.Enum):
    SDE = "sde"  # Flow-GRPO's SDE, a Gaussian around a corrected Euler step
    CPS = "cps"  # coefficients-preserving sampling
    DANCE = "dance"  # DanceGRPO's SDE: constant diffusion, a score-corrected Euler step
    ODE = "ode"  # plain Euler, deterministic, draws no noise

    @property
    def draws_noise(self) -> bool:
        return self is not TransitionKind.ODE


class LogProbForm(str, enum.Enum):
    """What `log_prob` holds per step: the mean over latent elements of one of these.

    Only `GAUSSIAN` and `GAUSSIAN_NO_CONST` differ by model-independent terms, so only they give
    the same PPO ratio; `SQUARED_ERROR` is not divided by 2 std^2, so its ratio is the true
    ratio raised to the power 2 std^2 (a step-dependent temperature).
    """

    GAUSSIAN = "gaussian"  # log N(x_next; mean, std^2), the true log-density
    GAUSSIAN_NO_CONST = "gaussian_no_const"  # drops -log(std) - log(sqrt(2 pi)): same ratio as GAUSSIAN
    SQUARED_ERROR = "squared_error"  # -(x_next - mean)^2: SGLang's `rollout_log_prob_no_const`, Flow-GRPO's CPS


@dataclass(frozen=True)
class HeldFrames:
    """The leading latent frames that each step holds at given values, per row: a video's first
    frame given as an image, as Wan2.2-TI2V-5B's pipeline replaces latent frame 0 by the image's
    latents before every model call and at the end. A held element is never drawn, so it takes no
    part in a step's log-prob.

    Attributes:
        rows: `(B,)` bool, the rows that hold frames (a batch mixes rows with and without).
        values: `(B, C, k, H, W)` fp32, the k frames each row holds (zeros in a row that holds none).
    """

    rows: torch.Tensor
    values: torch.Tensor

    def __post_init__(self):
        if self.rows.dtype != torch.bool or self.rows.shape != self.values.shape[:1] or self.values.ndim != 5:
            raise ValueError(
                f"held frames need (B,) bool rows and (B, C, k, H, W) values, got {tuple(self.rows.shape)} "
                f"{self.rows.dtype} and {tuple(self.values.shape)}"
            )

    @property
    def frames(self) -> int:
        return self.values.shape[2]

    def select(self, index: torch.Tensor) -> "HeldFrames":
        """Row j is this one's row `index[j]` (a tree's nodes take their root's)."""
        return HeldFrames(self.rows[index], self.values[index])

    def to(self, device: torch.device) -> "HeldFrames":
        return HeldFrames(self.rows.to(device), self.values.to(device))

    def hold(self, x: torch.Tensor) -> torch.Tensor:
        """Latents `(B, C, F, H, W)` with each holding row's first k frames replaced by its values."""
        frames = self.frames
        rows = self.rows.to(x.device).view(-1, 1, 1, 1, 1)
        held = torch.where(rows, self.values.to(x.device, x.dtype), x[:, :, :frames])
        return torch.cat([held, x[:, :, frames:]], dim=2)


@dataclass(frozen=True)
class Transition:
    """Result of one step for a batch of B samples; tensors are fp32.

    Attributes:
        x_next: `(B, ...)` the latents after the step.
        mean: `(B, ...)` the mean of x_next given x_t.
        noise_std: `()` standard deviation of x_next around `mean`; 0 for a deterministic step.
        log_prob: `(B,)` mean over latent elements (those not held, `HeldFrames`) of the
            log-density of x_next; 0 when deterministic.
    """

    x_next: torch.Tensor
    mean: torch.Tensor
    noise_std: torch.Tensor
    log_prob: torch.Tensor


def transition_distribution(
    kind: TransitionKind,
    x_t: torch.Tensor,
    v: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    eta: float,
    sigma_after_one: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean `(B, ...)` and standard deviation `()` of x_next given x_t, in fp32.

    Args:
        sigma_after_one: `sigmas[1]`, used by the SDE in place of sigma where sigma == 1 to keep
            sqrt(sigma / (1 - sigma)) finite at the first step.
    """
    x_t, v = x_t.float(), v.float()
    sigma, sigma_next = sigma.float(), sigma_next.float()
    dt = sigma_next - sigma
    if kind is TransitionKind.ODE:
        return x_t + dt * v, torch.zeros_like(sigma)
    if kind is TransitionKind.SDE:
        std = eta * torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_after_one.float(), sigma)))
        mean = x_t * (1 + std**2 * dt / (2 * sigma)) + v * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
        return mean, std * torch.sqrt(-dt)
    if kind is TransitionKind.DANCE:
        # DanceGRPO's `flux_step` (MixGRPO's and BranchGRPO's too), in its order of operations: the
        # Euler step, plus -eta^2/2 times the score of x_t given x0_hat = x_t - sigma v, times dt.
        x0_estimate = x_t - sigma * v
        score = -(x_t - x0_estimate * (1 - sigma)) / sigma**2
        mean = (x_t + dt * v) + (-0.5 * eta**2 * score) * dt
        return mean, eta * torch.sqrt(-dt)
    if kind is TransitionKind.CPS:
        std = sigma_next * math.sin(eta * math.pi / 2)
        x0_estimate = x_t - sigma * v
        noise_estimate = x_t + (1 - sigma) * v
        mean = x0_estimate * (1 - sigma_next) + noise_estimate * torch.sqrt(sigma_next**2 - std**2)
        return mean, std
    raise ValueError(f"unknown transition kind {kind!r}; expected one of {[k.value for k in TransitionKind]}")


def gaussian_log_prob(
    x_next: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    form: LogProbForm = LogProbForm.GAUSSIAN,
    held: HeldFrames | None = None,
) -> torch.Tensor:
    """Mean over the non-batch elements of the log-density of x_next in `form`, shape `(B,)`; in a
    row that holds frames (`held`), over the elements after them.

    A zero std means a deterministic step, whose log-prob is defined as 0 in every form, like
    the ODE's.
    """
    if not bool(std > 0):
        return torch.zeros(x_next.shape[0], dtype=torch.float32, device=x_next.device)
    squared_error = (x_next.float() - mean) ** 2
    if form is LogProbForm.SQUARED_ERROR:
        log_density = -squared_error
    else:
        log_density = -squared_error / (2 * std**2)
        if form is LogProbForm.GAUSSIAN:
            log_density = log_density - torch.log(std) - _LOG_SQRT_2PI
        elif form is not LogProbForm.GAUSSIAN_NO_CONST:
            raise ValueError(f"unknown log-prob form {form!r}; expected one of {[f.value for f in LogProbForm]}")
    reduce_dims = tuple(range(1, x_next.ndim))
    every_element = log_density.mean(dim=reduce_dims)
    if held is None:
        return every_element
    # Made contiguous, the free frames reduce as a tensor of their own shape would, in any batch.
    free_elements = log_density[:, :, held.frames :].contiguous().mean(dim=reduce_dims)
    return torch.where(held.rows.to(x_next.device), free_elements, every_element)


def take_step(
    kind: TransitionKind,
    x_t: torch.Tensor,
    v: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    *,
    eta: float,
    sigma_after_one: torch.Tensor,
    noise: torch.Tensor | None = None,
    x_next: torch.Tensor | None = None,
    log_prob_form: LogProbForm = LogProbForm.GAUSSIAN,
    held: HeldFrames | None = None,
    log_prob_std_scales: Sequence[float] | None = None,
) -> Transition:
    """Samples x_next from `noise` (standard normal, or scaled where a tree's branch step scales
    its children's noise), or scores a given `x_next`: pass exactly one.

    An ODE step takes neither: it is deterministic. The log-prob is always computed from x_next
    (never from the noise), so sampling and scoring the same x_next give the same bits. `held`
    frames replace x_next's (a given x_next already holds them) and leave its log-prob.
    `log_prob_std_scales`, one per row: the factor on the std in each row's log-prob (a branch
    step's scaled noise, `rollout.tree.Branching.log_prob_std_scale_at`); rows of factor 1 are
    scored with the step's std, as without it, so a row's bits do not depend on its neighbours'.
    """
    mean, std = transition_distribution(kind, x_t, v, sigma, sigma_next, eta, sigma_after_one)
    if kind.draws_noise and (noise is None) == (x_next is None):
        raise ValueError(f"a {kind.value} step needs exactly one of noise (to sample) or x_next (to score)")
    if x_next is None:
        x_next = mean if noise is None else mean + std * noise.float()
    if held is not None:
        x_next = held.hold(x_next)
    log_prob = gaussian_log_prob(x_next, mean, std, log_prob_form, held)
    for scale in sorted(set(log_prob_std_scales or ()) - {1.0}):
        rows = torch.tensor([k for k, s in enumerate(log_prob_std_scales) if s == scale], device=x_next.device)
        held_rows = None if held is None else held.select(rows)
        log_prob[rows] = gaussian_log_prob(x_next[rows], mean[rows], std * scale, log_prob_form, held_rows)
    return Transition(x_next=x_next.float(), mean=mean, noise_std=std, log_prob=log_prob)


def take_steps(
    kinds: Sequence[TransitionKind],
    x_t: torch.Tensor,
    v: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    *,
    eta: float,
    sigma_after_one: torch.Tensor,
    noise: torch.Tensor | None = None,
    x_next: torch.Tensor | None = None,
    log_prob_form: LogProbForm = LogProbForm.GAUSSIAN,
    held: HeldFrames | None = None,
    log_prob_std_scales: Sequence[float] | None = None,
) -> Transition:
    """`take_step` where rows take different kinds of step, one per row in `kinds` (a comb's spine
    and tails take ODE steps beside its children's stochastic ones): the rows of each kind in one
    call, each row's bits those of its kind's call. `noise` and `x_next`, where given, hold every
    row; a row of an ODE step ignores its noise. The `noise_std` returned is the stochastic rows'
    (a request's rows draw with one kind at most), 0 where no row draws."""
    distinct = list(dict.fromkeys(kinds))
    if len(distinct) == 1:
        (kind,) = distinct
        return take_step(
            kind, x_t, v, sigma, sigma_next, eta=eta, sigma_after_one=sigma_after_one,
            noise=noise if kind.draws_noise else None, x_next=x_next, log_prob_form=log_prob_form, held=held,
            log_prob_std_scales=log_prob_std_scales,
        )  # fmt: skip
    if sum(kind.draws_noise for kind in distinct) > 1:
        raise ValueError(f"rows of one step draw noise with one kind of step at most, got {[k.value for k in distinct]}")
    x_out = torch.empty(x_t.shape, dtype=torch.float32, device=x_t.device)
    mean_out = torch.empty_like(x_out)
    log_prob_out = torch.empty(x_t.shape[0], dtype=torch.float32, device=x_t.device)
    noise_std = torch.zeros((), dtype=torch.float32, device=x_t.device)
    for kind in distinct:
        rows = [row for row, row_kind in enumerate(kinds) if row_kind is kind]
        index = torch.tensor(rows, device=x_t.device)
        part = take_step(
            kind, x_t[index], v[index], sigma, sigma_next, eta=eta, sigma_after_one=sigma_after_one,
            noise=noise[index] if kind.draws_noise and noise is not None else None,
            x_next=None if x_next is None else x_next[index], log_prob_form=log_prob_form,
            held=None if held is None else held.select(index),
            log_prob_std_scales=None if log_prob_std_scales is None else [log_prob_std_scales[row] for row in rows],
        )  # fmt: skip
        x_out[index], mean_out[index], log_prob_out[index] = part.x_next, part.mean, part.log_prob
        if kind.draws_noise:
            noise_std = part.noise_std
    return Transition(x_next=x_out, mean=mean_out, noise_std=noise_std, log_prob=log_prob_out)


def noise_std_of(
    kind: TransitionKind, sigma: torch.Tensor, sigma_next: torch.Tensor, *, eta: float, sigma_after_one: torch.Tensor
) -> torch.Tensor:
    """The `()` std of a `kind` step's x_next, as `take_step` computes it (the std depends on the
    schedule and `eta` alone, so no rows are needed)."""
    no_rows = torch.zeros((0,), dtype=torch.float32, device=sigma.device)
    return transition_distribution(kind, no_rows, no_rows, sigma, sigma_next, eta, sigma_after_one)[1]
