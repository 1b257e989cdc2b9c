"""Every guarantee over generated valid requests: the request space as a property test.

A generated case is a valid `/rollout/generate` body (every field that changes what is sampled:
prompts and fan-out, seed, steps, size and frames, sde / cps / ode, noise level, the SDE window,
the kept latents, debug and env flags, guidance, the log-prob form, branch steps and factors,
split noise, trees and combs) and
the model it goes to (the embedded model or a tiny family, image or video; fp32 or bf16; with or
without a LoRA adapter served; its micro-batch size and how it keeps batch invariance). Each case
is planned and sampled as a worker does (`plan_rollout`, then `sample_tree` on its roots) and
checked against formulas written here in float64, not against the code under test:

- shapes: `[T+1]` fp32 sigmas ending in 0, `[T]` timesteps, one kept latent per returned step
  index, the last equal to `final_latents`, `[T]` log-probs, every tensor finite;
- each step from the debug tensors of the same request with every latent kept: the mean and
  std of the transition recomputed by the Flow-GRPO / DanceGRPO / CPS formulas (in a comb, the
  ODE step wherever a leaf takes one), `x_{s+1} == mean + std * noise` bit for bit, and the
  log-prob recomputed from the returned latents;
- replay difference 0, determinism across two sends, batch invariance against companions and
  against the request's chunks sampled apart, the object store's round trip, a dataset's write
  and load, each leaf regrown alone, and resumed from a latent it keeps half way with its own
  tail (the same bits from there on);
- in a tree, each pair of leaves bit-identical up to the branch step where their paths part, and
  different from there on;
- the transformer rows computed, and the `transformer_rows` a client is told (`rollout.cost`),
  against the tree's own count of live nodes per step.

`tests/test_request_properties.py` runs a small budget of cases; the served paths (HTTP msgpack ==
JSON == handle) are `tests/deployments/test_request_properties_app.py`'s. For a large budget:

    .venv/bin/python -m benchmarks.properties --examples 2000 --seed 0

Every counterexample ever found is kept in `REGRESSIONS` and run first.
"""

from __future__ import annotations

import argparse
import base64
import copy
import dataclasses
import io
import math
import pickle
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from hypothesis import HealthCheck, given, reject, seed, settings
from hypothesis import strategies as st

from rollout.calibration import require_batch_invariance
from rollout.codec import encode_tensor
from rollout.cost import transformer_cost
from rollout.dataset import PER_SAMPLE_TENSORS, RolloutDatasetWriter, load_rollouts
from rollout.errors import ModelLoadError
from rollout.input_images import ImageInputLimits, decode_input_image
from rollout.kernels import BatchInvariance
from rollout.micro_batching import MicroBatching
from rollout.models.choice import EMBEDDED_MODEL
from rollout.models.registry import load_pipeline
from rollout.options import MAX_SEED
from rollout.plan import RequestLimits, plan_rollout
from rollout.replay import replay_log_probs, replayable_steps
from rollout.sampler import micro_batch_size, resolve_options, sample_tree
from rollout.schema import parse_request
from rollout.testing.families import TINY_FAMILIES, RequestSpace
from rollout.trajectory import RolloutBatch, SampleTrajectory
from rollout.tree import Branching, TreeRoot

MAX_STEPS = 6
MAX_SAMPLES = 8  # per request
LIMITS = RequestLimits()


# Copy name -> the record of a tiny copy that requests go to (`rollout.testing.families`: at least
# one per model, each with the part of the request space it takes; Wan's TI2V layout with images is
# a copy of its own beside Wan2.1's).
COPIES = {record.name: record for record in TINY_FAMILIES.values() if record.requests}


@dataclass(frozen=True)
class Case:
    """One generated request and everything about how it is served.

    Attributes:
        copy: the tiny copy (`COPIES`) that serves it, as its model.
        body: the request as a client sends it.
        micro_batch_size, invariance: the model's micro-batching for this case.
        chunk_size: samples per piece of work when the request is cut (dispatch's chunks).
        companions: `(prompt, seed, branching, images)` of other roots sampled in the same call
            (`images`: their prompt's input images, () for none).
        companion_position: where among the request's roots the companions go.
    """

    copy: str
    dtype: str
    lora: bool
    body: dict[str, Any]
    micro_batch_size: int
    invariance: str
    chunk_size: int
    companions: tuple[tuple[str, int, Branching, tuple], ...] = ()
    companion_position: int = 0

    @property
    def model(self) -> str:
        return COPIES[self.copy].model


class PropertyViolation(AssertionError):
    """A guarantee that did not hold for a generated request."""


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise PropertyViolation(what)


# Generating requests ----------------------------------------------------------------------------


def _subset(draw, values: range) -> list[int]:
    return sorted(draw(st.sets(st.sampled_from(list(values)), max_size=len(values))) if len(values) else [])


def stochastic_kind(body: dict[str, Any], step: int) -> str:
    """The transition of `step` as the request's fields define it (not the library's code)."""
    if not body.get("rollout", True):
        return "ode"
    window = body.get("rollout_sde_step_indices")
    if window is not None and step not in window:
        return "ode"
    return body.get("rollout_sde_type", "sde")


def is_comb(body: dict[str, Any]) -> bool:
    return body.get("rollout_branch_shape") == "comb"


def sample_kind(body: dict[str, Any], path: tuple[int, ...], step: int) -> str:
    """The transition the leaf at `path` took at `step`, as the request's fields define it: the
    request's, but in a comb only a child's step at its branch step, every other step an ODE step."""
    if not is_comb(body):
        return stochastic_kind(body, step)
    if path and path[-1] != 0 and step == body["rollout_branch_steps"][len(path) - 1]:
        return stochastic_kind(body, step)
    return "ode"


def leaves_per_root(body: dict[str, Any]) -> int:
    factors = body.get("rollout_branch_factors", [])
    return 1 + sum(factors) if is_comb(body) else math.prod(factors)


@st.composite
def rollout_bodies(draw, space: RequestSpace) -> dict[str, Any]:
    """A valid `/rollout/generate` body from a model's part of the request space."""
    steps = draw(st.integers(space.min_steps, MAX_STEPS))
    body: dict[str, Any] = {"num_inference_steps": steps}
    prompts = draw(st.lists(st.sampled_from(space.prompts), min_size=1, max_size=3))
    body["prompt"] = prompts[0] if len(prompts) == 1 and draw(st.booleans()) else prompts
    negative = draw(st.sampled_from(["none", "one", "each"]))
    if negative == "one":
        body["negative_prompt"] = draw(st.sampled_from(("",) + space.prompts))
    elif negative == "each" and isinstance(body["prompt"], list):
        body["negative_prompt"] = [draw(st.sampled_from(("",) + space.prompts)) for _ in prompts]
    image_size = _image_size(draw, space)
    if image_size is not None:  # one image a prompt, each its own pixels
        first = draw(st.integers(0, 2**16))
        uris = [_png_data_uri(*image_size, first + i) for i in range(len(prompts))]
        body["image_path"] = uris if isinstance(body["prompt"], list) else uris[0]
    size = draw(st.sampled_from(space.sizes))
    if size is not None:
        body["height"] = body["width"] = size
    frames = draw(st.sampled_from(space.frames))
    if frames is not None:
        body["num_frames"] = frames
    for field, values in (("guidance_scale", space.guidance_scales), ("true_cfg_scale", space.true_cfg_scales)):
        value = draw(st.sampled_from(values))
        if value is not None:
            body[field] = value
    rollout = draw(st.sampled_from([True, True, True, False]))
    if not rollout:
        body["rollout"] = False
    sde_type = draw(st.sampled_from(["sde", "sde", "cps", "cps", "dance", "dance", "ode"]))
    body["rollout_sde_type"] = sde_type
    largest_eta = 1.0 if sde_type == "cps" else 1.5
    body["rollout_noise_level"] = draw(st.one_of(st.just(0.0), st.floats(0.05, largest_eta), st.sampled_from([0.3, 0.7])))
    if draw(st.booleans()):
        body["rollout_sde_step_indices"] = _subset(draw, range(steps))
    if draw(st.booleans()):
        body["rollout_return_dit_trajectory"] = True
    if draw(st.booleans()):
        body["rollout_return_step_indices"] = _subset(draw, range(steps + 1))
    body["rollout_debug_mode"] = draw(st.booleans())
    body["rollout_return_denoising_env"] = draw(st.booleans())
    form = draw(st.sampled_from([None, "gaussian", "gaussian_no_const", "squared_error", "no_const"]))
    if form == "no_const":
        body["rollout_log_prob_no_const"] = True
    elif form is not None:
        body["rollout_log_prob_form"] = form

    leaves = 1
    branchable = [step for step in range(steps) if _can_branch(body, step, steps)]
    if branchable and draw(st.sampled_from([True, True, False])):
        branch_steps = sorted(draw(st.sets(st.sampled_from(branchable), min_size=1, max_size=min(3, len(branchable)))))
        comb = draw(st.sampled_from([False, False, True]))  # TempFlow-GRPO's comb: an ODE spine and its children
        if comb:
            body["rollout_branch_shape"] = "comb"
        factors = [draw(st.integers(1, 3) if comb else st.integers(2, 3)) for _ in branch_steps]
        while leaves_per_root({**body, "rollout_branch_factors": factors}) > MAX_SAMPLES:
            factors.pop()
            branch_steps.pop()
        body["rollout_branch_steps"], body["rollout_branch_factors"] = branch_steps, factors
        if draw(st.booleans()):  # BranchGRPO's split noise: a scale per branch step, the log-prob's std either way
            body["rollout_branch_noise_scales"] = [draw(st.sampled_from([1, 0.5, 2, 4.0])) for _ in branch_steps]
            body["rollout_branch_log_prob_std"] = draw(st.sampled_from(["scaled", "nominal"]))
        leaves = leaves_per_root(body)
    roots_per_prompt = draw(st.integers(1, max(1, MAX_SAMPLES // (leaves * len(prompts)))))
    body["num_outputs_per_prompt"] = leaves * roots_per_prompt
    samples = len(prompts) * body["num_outputs_per_prompt"]
    body["seed"] = draw(st.one_of(st.integers(0, 2**32), st.just(MAX_SEED - samples + 1)))
    return body


def _image_size(draw, space: RequestSpace) -> tuple[int, int] | None:
    """An input image's size from the space, or None; draws nothing for a model without images,
    so that its requests are the ones drawn before images existed."""
    return None if space.image_sizes == (None,) else draw(st.sampled_from(space.image_sizes))


def _png_data_uri(height: int, width: int, seed: int) -> str:
    """A random RGB image as a client sends it in JSON: a PNG data URI."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _decoded_image(height: int, width: int, seed: int):
    """`_png_data_uri`'s image as the server decodes it: a companion root's input image."""
    return decode_input_image(_png_data_uri(height, width, seed), "image_path", ImageInputLimits())


def _can_branch(body: dict[str, Any], step: int, steps: int) -> bool:
    """Whether the children of a branch at `step` would draw noise of a non-zero std."""
    kind = stochastic_kind(body, step)
    if kind == "ode" or body["rollout_noise_level"] == 0:
        return False
    return not (kind == "cps" and step == steps - 1)


@st.composite
def cases(draw, copies: tuple[str, ...] = tuple(COPIES)) -> Case:
    record = COPIES[draw(st.sampled_from(copies))]
    space = record.requests
    body = draw(rollout_bodies(space))
    companions = []
    for _ in range(draw(st.integers(0, 2))):
        # Companions share the request's options (a call samples one set), not its tree.
        branching = Branching()
        if "rollout_branch_steps" in body and draw(st.booleans()):  # a tree or a comb, whichever the request is
            branching = Branching((body["rollout_branch_steps"][0],), (2,), shape=draw(st.sampled_from(["tree", "comb"])))
        image_size = _image_size(draw, space)
        images = () if image_size is None else (_decoded_image(*image_size, draw(st.integers(0, 2**16))),)
        companions.append((draw(st.sampled_from(space.prompts)), draw(st.integers(0, 2**32)), branching, images))
    return Case(
        copy=record.name,
        dtype=draw(st.sampled_from(space.dtypes)),
        lora=draw(st.booleans()),
        body=body,
        # Padding at 3 rows is a size the server's start-up check refuses on this CPU (`servable`).
        micro_batch_size=draw(st.sampled_from([1, 2, 4])),
        invariance=draw(st.sampled_from([BatchInvariance.PADDING.value, BatchInvariance.KERNELS.value])),
        chunk_size=draw(st.integers(1, MAX_SAMPLES)),
        companions=tuple(companions),
        companion_position=draw(st.integers(0, 8)),
    )


# The models -------------------------------------------------------------------------------------



@lru_cache(maxsize=None)
def pipeline_for(copy_name: str, dtype: str, lora: bool):
    """The model of a case, loaded once per process (its micro-batching is set per case)."""
    record = COPIES[copy_name]
    path = None if record.embedded else record.build(Path(tempfile.mkdtemp(prefix="rollout-properties-")) / record.name)
    pipeline = load_pipeline(record.model, path, device="cpu", dtype=getattr(torch, dtype))
    if lora:
        _serve_a_lora(pipeline)
    return pipeline


def _serve_a_lora(pipeline) -> None:
    """Serves a rank-2 adapter with random non-zero weights on the transformer's attention, as a
    trainer's LoRA push does."""
    from peft import LoraConfig, get_peft_model_state_dict

    from rollout.weights import apply_update, tensor_update

    transformer = pipeline.weight_modules["transformer"]
    trainer = copy.deepcopy(transformer)
    trainer.add_adapter(LoraConfig(r=2, lora_alpha=4, target_modules=["to_q", "to_v"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in trainer.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=generator))
    update = tensor_update(get_peft_model_state_dict(trainer), lora_rank=2, lora_alpha=4)
    apply_update(pipeline.weight_modules, update)


# Running a case ---------------------------------------------------------------------------------


@dataclass
class Served:
    """A case's request, planned and sampled as a worker samples it."""

    roots: list[TreeRoot]
    options: Any
    batch: RolloutBatch
    transformer_rows: int


def serve_case(case: Case, **option_changes) -> Served:
    """Plans the case's request and samples it in one call, as one worker call would
    (`option_changes` replace fields of the resolved options, e.g. to keep every latent)."""
    pipeline = _configured(case)
    plan = plan_rollout(parse_request(case.body), LIMITS)
    options = dataclasses.replace(resolve_options(pipeline, plan.options), **option_changes)
    roots = plan.roots()
    call = sample_tree(pipeline, roots, options, weight_version="properties")
    return Served(roots, options, call.batch, call.transformer_rows)


def _configured(case: Case):
    pipeline = pipeline_for(case.copy, case.dtype, case.lora)
    pipeline.micro_batching = MicroBatching(case.micro_batch_size, invariance=BatchInvariance(case.invariance))
    return pipeline


@lru_cache(maxsize=None)
def servable(copy_name: str, dtype: str, lora: bool, micro_batch_size: int, invariance: str, height: int, width: int) -> bool:
    """Whether a worker would serve this configuration: its start-up check that a sample's bits do
    not depend on its companions (`require_batch_invariance`) holds on this machine."""
    case = Case(copy_name, dtype, lora, {}, micro_batch_size, invariance, chunk_size=1)
    try:
        require_batch_invariance(_configured(case), height, width)
    except ModelLoadError:
        return False
    return True


def check_case(case: Case) -> None:
    """Raises `PropertyViolation` naming the first guarantee `case` breaks; a configuration no
    worker would serve is rejected (Hypothesis draws another)."""
    served = serve_case(case)
    how = (case.copy, case.dtype, case.lora, case.micro_batch_size, case.invariance)
    if not servable(*how, served.options.height, served.options.width):
        reject()
    full = serve_case(case, debug=True, return_step_indices=None)
    batch, options, steps = served.batch, served.options, served.options.num_inference_steps
    check_shapes(batch, options)
    check_flags_change_no_bits(batch, full.batch)
    check_steps_against_the_formulas(case.body, full.batch, held_frames(case, full.batch))
    check_replay(case, full.batch)  # every step; what the request kept is bit-equal to it
    again = serve_case(case)
    for a, b in zip(batch.samples, again.batch.samples):
        expect_same_sample(a, b, "sent twice")
    check_batch_invariance(case, served)
    check_object_store(batch)
    check_dataset(batch)
    check_leaves_grown_alone(case, served)
    check_leaves_resumed(case, served)
    check_tree(case.body, full.batch, steps)
    check_cost(case, served)


def check_shapes(batch: RolloutBatch, options) -> None:
    steps = options.num_inference_steps
    schedule = batch.schedule
    expect(schedule.sigmas.shape == (steps + 1,) and schedule.sigmas.dtype == torch.float32, "sigmas are [T+1] fp32")
    expect(float(schedule.sigmas[-1]) == 0.0, "sigmas end in 0")
    expect(bool((schedule.sigmas[:-1] > schedule.sigmas[1:]).all()), "sigmas decrease")
    expect(schedule.timesteps.shape == (steps,), "timesteps are [T]")
    kept = list(options.kept_latent_steps())
    for sample in batch.samples:
        expect(sample.schedule is schedule, "every sample refers to the request's schedule")
        expect(sample.latent_step_indices.tolist() == kept, f"latent_step_indices {sample.latent_step_indices.tolist()} != {kept}")
        expect(sample.latents.shape[0] == len(kept), f"{sample.latents.shape[0]} latents for {len(kept)} step indices")
        if kept and kept[-1] == steps:
            expect(torch.equal(sample.latents[-1], sample.final_latents), "the last kept latent is final_latents")
        expect(sample.log_probs.shape == (steps,), f"log_probs {tuple(sample.log_probs.shape)}, not [T]")
        for name, tensor in sample.tensors().items():
            expect(not tensor.is_floating_point() or bool(torch.isfinite(tensor).all()), f"{name} is not finite")


def check_flags_change_no_bits(batch: RolloutBatch, full: RolloutBatch) -> None:
    """Debug tensors and the latents kept change what is returned, never what is sampled."""
    for sample, whole in zip(batch.samples, full.samples):
        for name in ("image", "final_latents", "log_probs"):
            expect(torch.equal(getattr(sample, name), getattr(whole, name)), f"{name} changes with debug / kept latents")
        kept = sample.latent_step_indices
        expect(torch.equal(sample.latents, whole.latents[kept]), "kept latents differ from the full trajectory's")
        if sample.debug is not None:
            for name in ("model_outputs", "prev_sample_means", "noise_std_devs", "variance_noises"):
                expect(torch.equal(getattr(sample.debug, name), getattr(whole.debug, name)), f"debug.{name} changes")
        expect(sample.seed == whole.seed and sample.branch_path == whole.branch_path, "seeds or paths change")


def reference_transition(kind: str, x: np.ndarray, v: np.ndarray, sigma: float, sigma_next: float, eta: float, sigma_1: float):
    """Mean and std of x_next in float64: Flow-GRPO's SDE, CPS, DanceGRPO's SDE, or the Euler step."""
    dt = sigma_next - sigma
    if kind == "ode":
        return x + dt * v, 0.0
    if kind == "dance":
        score = -(x - (x - sigma * v) * (1 - sigma)) / sigma**2
        return x + dt * v - 0.5 * eta**2 * score * dt, eta * math.sqrt(sigma - sigma_next)
    if kind == "sde":
        std = eta * math.sqrt(sigma / (1 - (sigma_1 if sigma == 1 else sigma)))
        mean = x * (1 + std**2 * dt / (2 * sigma)) + v * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
        return mean, std * math.sqrt(-dt)
    std = sigma_next * math.sin(eta * math.pi / 2)
    return (x - sigma * v) * (1 - sigma_next) + (x + (1 - sigma) * v) * math.sqrt(sigma_next**2 - std**2), std


def reference_log_prob(x_next: np.ndarray, mean: np.ndarray, std: float, form: str) -> tuple[float, float]:
    """The mean log-density of x_next in `form`, and how far fp32 rounding of x_next and the
    mean may move it."""
    if std == 0:
        return 0.0, 0.0
    residual = x_next - mean
    rounding = 2.0 ** -23 * (np.abs(x_next) + np.abs(mean))  # an ulp of each, at most
    if form == "squared_error":
        return float(-(residual**2).mean()), float((2 * np.abs(residual) * rounding + rounding**2).mean())
    density = -(residual**2) / (2 * std**2)
    error = float(((np.abs(residual) * rounding + rounding**2) / std**2).mean())
    if form == "gaussian":
        density = density - math.log(std) - 0.5 * math.log(2 * math.pi)
    return float(density.mean()), error


def _form(body: dict[str, Any]) -> str:
    if body.get("rollout_log_prob_no_const"):
        return "squared_error"
    return body.get("rollout_log_prob_form") or "gaussian"


def held_frames(case: Case, batch: RolloutBatch) -> list[torch.Tensor | None]:
    """Each sample's latent frames `(C, k, H, W)` that the model holds at every step
    (`RolloutPipeline.held_frames`: a first frame given as an image), from its prompt and images
    encoded again; None for a sample that holds none."""
    pipeline = _configured(case)
    samples = batch.samples
    conditioning = pipeline.encode_prompts(
        [s.prompt for s in samples], [s.negative_prompt for s in samples], batch.options, [s.condition_images for s in samples]
    )
    held = pipeline.held_frames(conditioning)
    return [None if held is None or not held.rows[i] else held.values[i] for i in range(len(samples))]


def check_steps_against_the_formulas(body: dict[str, Any], full: RolloutBatch, held: list[torch.Tensor | None]) -> None:
    """Every step of every sample, from its latents and velocity, against the formulas above; a
    sample's `held` frames are in every latent, and its steps sample (and score) the others."""
    sigmas = full.schedule.sigmas.double().numpy()
    eta = body.get("rollout_noise_level", 0.7) if body.get("rollout", True) else 0.0
    form = _form(body)
    for sample, held_frames_of_sample in zip(full.samples, held, strict=True):
        debug = sample.debug
        latents = sample.latents.double().numpy()
        sampled = (slice(None),)  # the elements each step draws: all, or the frames after the held ones
        if held_frames_of_sample is not None:
            frames = held_frames_of_sample.shape[1]
            sampled = (slice(None), slice(frames, None))
            for k, kept in enumerate(sample.latents):
                expect(torch.equal(kept[:, :frames], held_frames_of_sample), f"sample seed {sample.seed}: latent {k} lets its held frames go")
        for step in range(len(sigmas) - 1):
            kind = sample_kind(body, sample.branch_path, step)
            where = f"sample seed {sample.seed} path {sample.branch_path}, step {step} ({kind})"
            x, v = latents[step], debug.model_outputs[step].double().numpy()
            mean, std = reference_transition(kind, x, v, sigmas[step], sigmas[step + 1], eta, sigmas[1])
            # The debug std is the request's step's, whichever step this sample took (a comb's ODE rows).
            _, request_std = reference_transition(stochastic_kind(body, step), x, v, sigmas[step], sigmas[step + 1], eta, sigmas[1])
            returned_std = float(debug.noise_std_devs[step])
            expect(math.isclose(returned_std, request_std, rel_tol=1e-5, abs_tol=1e-7), f"{where}: std {returned_std} != {request_std}")
            scale = 1 + np.abs(x) + np.abs(v)
            if kind == "dance":
                # DanceGRPO's score divides x_t - x0_hat (1 - sigma), a difference of near-equal terms,
                # by sigma^2, and the step takes eta^2 |dt| / 2 of it: fp32's rounding of x_t and v grows
                # by that much (500x at sigma 0.001, the embedded model's last step of two), in its code
                # as here.
                scale = scale * (1 + 0.5 * eta**2 * (sigmas[step] - sigmas[step + 1]) / sigmas[step] ** 2)
            elif kind == "cps":
                # The mean's sqrt(sigma_next^2 - std^2), std = sigma_next sin(eta pi / 2), is near eta 1 a
                # difference of near-equal squares: fp32's rounding of them (a few ulps of sigma_next^2)
                # moves the root by up to sqrt(root^2 + 4 ulp) - root, times the noise estimate (in
                # CPS's code as here); negligible elsewhere (2e-7 at eta 0.7).
                s_next = sigmas[step + 1]
                root = math.sqrt(max(s_next**2 - std**2, 0.0))
                moved = math.sqrt(root**2 + 4 * 2.0**-24 * s_next**2) - root
                scale = scale + moved * np.abs(x + (1 - sigmas[step]) * v) / 1e-5
            mean_error = float((np.abs(debug.prev_sample_means[step].double().numpy() - mean) / scale).max())
            expect(mean_error < 1e-5, f"{where}: the mean is off the formula by {mean_error:.2e} (relative)")
            taken = debug.prev_sample_means[step] + debug.noise_std_devs[step] * debug.variance_noises[step]
            expect(torch.equal(sample.latents[step + 1][sampled], taken[sampled]), f"{where}: x_(s+1) != mean + std * noise")
            if kind == "ode":  # draws no noise (a stochastic step of std 0, CPS's last, still draws one)
                expect(bool((debug.variance_noises[step] == 0).all()), f"{where}: an ode step records noise")
            mean_taken = debug.prev_sample_means[step].double().numpy()
            took_the_requests = kind == stochastic_kind(body, step)  # then its std is the one returned
            log_prob_std = (returned_std if took_the_requests else std) * sample.branching.log_prob_std_scale_at(step)
            expected, rounding = reference_log_prob(latents[step + 1][sampled], mean_taken[sampled], log_prob_std, form)
            got = float(sample.log_probs[step])
            tolerance = 1e-5 * (1 + abs(expected)) + 8 * rounding
            expect(abs(got - expected) <= tolerance, f"{where}: log-prob {got} != {expected} (+- {tolerance:.1e})")


def check_replay(case: Case, batch: RolloutBatch) -> None:
    """A trainer's replay of what was returned gives the log-probs back bit for bit."""
    steps = replayable_steps(batch.samples[0].latent_step_indices)
    if not steps:
        return
    replayed = replay_log_probs(_configured(case), batch.schedule, batch.options, batch.samples)
    returned = torch.stack([s.log_probs for s in batch.samples])[:, steps]
    difference = (replayed.log_probs - returned).abs().max().item()
    expect(torch.equal(replayed.log_probs, returned), f"replay difference {difference:.3e} on steps {steps}")


def expect_same_sample(a: SampleTrajectory, b: SampleTrajectory, how: str) -> None:
    expect((a.seed, a.branch_path, a.prompt) == (b.seed, b.branch_path, b.prompt), f"{how}: another sample")
    theirs = b.tensors()
    for name, tensor in a.tensors().items():
        expect(torch.equal(tensor, theirs[name]), f"{how}: {name} of seed {a.seed} path {a.branch_path} differs")
    if a.denoising_env is not None:
        for part, value in a.denoising_env.items():
            tensors = value if isinstance(value, dict) else {"": value}
            theirs = b.denoising_env[part] if isinstance(value, dict) else {"": b.denoising_env[part]}
            for name, tensor in tensors.items():
                if isinstance(tensor, torch.Tensor):
                    expect(torch.equal(tensor, theirs[name]), f"{how}: denoising_env {part} {name} differs")
    expect(
        [i.digest for i in a.condition_images] == [i.digest for i in b.condition_images], f"{how}: other input images"
    )


def check_batch_invariance(case: Case, served: Served) -> None:
    """The request's samples keep their bits among other requests' roots in one call, and when
    the request is cut into chunks sampled by separate calls."""
    pipeline = _configured(case)
    if case.companions:
        companions = [TreeRoot(prompt, "", s, branching, images=images) for prompt, s, branching, images in case.companions]
        position = case.companion_position % (len(served.roots) + 1)
        roots = served.roots[:position] + companions + served.roots[position:]
        leaves = sample_tree(pipeline, roots, served.options).batch.samples
        before = sum(root.branching.leaves_per_root for root in roots[:position])
        own = leaves[:before] + leaves[before + sum(c.branching.leaves_per_root for c in companions) :]
        for a, b in zip(served.batch.samples, own):
            expect_same_sample(a, b, "with companions in its call")
    per_root = served.roots[0].branching.leaves_per_root
    roots_per_chunk = max(1, case.chunk_size // per_root)
    if roots_per_chunk < len(served.roots):
        chunked = []
        for start in range(0, len(served.roots), roots_per_chunk):
            chunk = served.roots[start : start + roots_per_chunk]
            chunked += sample_tree(pipeline, chunk, served.options).batch.samples
        for a, b in zip(served.batch.samples, chunked):
            expect_same_sample(a, b, f"in chunks of {roots_per_chunk} roots")


def check_object_store(batch: RolloutBatch) -> None:
    """What Ray's object store does to a batch: a pickle round trip keeps every bit and the schedule
    shared."""
    back = pickle.loads(pickle.dumps(batch))
    expect(all(s.schedule is back.schedule for s in back.samples), "the schedule is not shared after a round trip")
    expect(back.schedule.equals(batch.schedule), "the schedule changed in a round trip")
    for a, b in zip(batch.samples, back.samples):
        expect_same_sample(a, b, "through the object store")


def check_dataset(batch: RolloutBatch) -> None:
    with tempfile.TemporaryDirectory() as directory:
        with RolloutDatasetWriter(directory) as writer:
            writer.write(batch)
        _, (loaded,) = load_rollouts(directory)
    expect(loaded.schedule.equals(batch.schedule), "the dataset's schedule differs")
    expect(loaded.options == batch.options, "the dataset's options differ")
    for a, b in zip(batch.samples, loaded.samples):
        expect((a.seed, a.prompt, a.branching, a.branch_path) == (b.seed, b.prompt, b.branching, b.branch_path), "dataset: another sample")
        for name in PER_SAMPLE_TENSORS:  # what a dataset stores (debug tensors are not)
            expect(torch.equal(getattr(a, name), getattr(b, name)), f"dataset: {name} differs")


def check_leaves_grown_alone(case: Case, served: Served) -> None:
    """Leaves (the first and the last) regrown alone from what their rows say equal their rows."""
    pipeline = _configured(case)
    leaves = served.batch.samples
    for leaf in {id(leaf): leaf for leaf in (leaves[0], leaves[-1])}.values():
        (alone,) = sample_tree(pipeline, [TreeRoot.of_leaf(leaf)], served.options).batch.samples
        expect_same_sample(leaf, alone, "grown alone")


def check_leaves_resumed(case: Case, served: Served) -> None:
    """Leaves (the first and the last) resumed half way by a request, from a latent they keep, with
    their node's path (`rollout_resume_branch_paths`), their root's seed and their own tail:
    equal to their rows from there on; the steps before it are not taken (zeros)."""
    pipeline = _configured(case)
    samples = served.batch.samples
    for leaf, prompt in {id(leaf): (leaf, k) for leaf, k in ((samples[0], 0), (samples[-1], -1))}.values():
        kept = [step for step in leaf.latent_step_indices.tolist() if step < served.options.num_inference_steps]
        if not kept:
            return
        step = kept[len(kept) // 2]
        node = leaf.branch_path[: leaf.branching.depth_at(step)]
        body = {**case.body, "prompt": [leaf.prompt], "negative_prompt": [leaf.negative_prompt], "seed": leaf.root_seed,
                "num_outputs_per_prompt": len(leaf.branching.leaves_below(node)), "rollout_resume_step": step,
                "rollout_resume_latents": [encode_tensor(leaf.latents[kept.index(step)], binary=False)],
                "rollout_resume_branch_paths": [list(node)]}  # fmt: skip
        if "image_path" in body:  # the prompt's images, as a list of one prompt's
            body["image_path"] = [body["image_path"][prompt] if isinstance(case.body["prompt"], list) else body["image_path"]]
        if body.get("rollout_return_step_indices") is not None:
            body["rollout_return_step_indices"] = [k for k in body["rollout_return_step_indices"] if k >= step]
        plan = plan_rollout(parse_request(body), LIMITS)
        resumed = sample_tree(pipeline, plan.roots(), resolve_options(pipeline, plan.options)).batch.samples
        (again,) = [sample for sample in resumed if sample.branch_path == leaf.branch_path]
        where = f"resumed at step {step} from node {list(node)}"
        expect(again.seed == leaf.seed, f"{where}: the seed differs")
        first = kept.index(step)
        expect(torch.equal(again.latents, leaf.latents[first:]), f"{where}: the latents differ")
        expect(torch.equal(again.log_probs[step:], leaf.log_probs[step:]), f"{where}: the log-probs differ")
        expect(not again.log_probs[:step].any(), f"{where}: log-probs before it")
        expect(torch.equal(again.image, leaf.image), f"{where}: the output differs")


def check_tree(body: dict[str, Any], full: RolloutBatch, steps: int) -> None:
    """Leaves of one root: bit-identical up to the branch step where their paths part (latents
    x_0 .. x_b, log-probs and velocities of steps before b, and b's velocity), different from there."""
    branch_steps = body.get("rollout_branch_steps", [])
    roots: dict[tuple, list[SampleTrajectory]] = {}
    for leaf in full.samples:
        roots.setdefault((leaf.prompt, leaf.negative_prompt, leaf.root_seed), []).append(leaf)
    for leaves in roots.values():
        expect(len(leaves) == leaves_per_root(body), "a root lacks leaves")
        for i, a in enumerate(leaves):
            for b in leaves[i + 1 :]:
                depth = next(d for d, (p, q) in enumerate(zip(a.branch_path, b.branch_path)) if p != q)
                step = branch_steps[depth]
                where = f"leaves {a.branch_path} and {b.branch_path} (branch step {step})"
                expect(torch.equal(a.latents[: step + 1], b.latents[: step + 1]), f"{where}: the shared prefix differs")
                expect(torch.equal(a.log_probs[:step], b.log_probs[:step]), f"{where}: shared log-probs differ")
                expect(torch.equal(a.debug.model_outputs[: step + 1], b.debug.model_outputs[: step + 1]), f"{where}: shared velocities differ")
                expect(not torch.equal(a.latents[step + 1], b.latents[step + 1]), f"{where}: x_(b+1) is the same")
                expect(not torch.equal(a.debug.variance_noises[step], b.debug.variance_noises[step]), f"{where}: the same noise")


def check_cost(case: Case, served: Served) -> None:
    """The rows the transformer computed, and what the client is told (`rollout.cost`), against the
    tree's own count: at step s each root has one live node per path through the branch steps
    before s (its velocity at a branch step is its parent's, computed once), and a call's rows are
    padded to whole micro-batches unless the kernels keep invariance."""
    pipeline = _configured(case)
    samples_per_call = micro_batch_size(pipeline, served.options)
    kernels = case.invariance == BatchInvariance.KERNELS.value

    def padded(rows: int) -> int:
        return rows if kernels else math.ceil(rows / samples_per_call) * samples_per_call

    branch_steps, factors = case.body.get("rollout_branch_steps", []), case.body.get("rollout_branch_factors", [])
    steps = served.options.num_inference_steps
    if is_comb(case.body):  # the spine, and the children of every branch step before s
        live = [1 + sum(f for b, f in zip(branch_steps, factors) if b < step) for step in range(steps)]
    else:
        live = [math.prod(f for b, f in zip(branch_steps, factors) if b < step) for step in range(steps)]
    expected = sum(padded(len(served.roots) * nodes) for nodes in live)
    told = transformer_cost(pipeline, served.roots, served.options)
    expect(told.transformer_rows_unbranched == steps * padded(len(served.batch.samples)), "transformer_rows_unbranched")
    if hasattr(pipeline, "text_length_bucket"):  # Qwen-Image's and its edit model's text buckets run in calls of their own
        expect(served.transformer_rows >= expected, f"{served.transformer_rows} transformer rows, fewer than {expected}")
        expect(told.transformer_rows == expected, f"transformer_rows told {told.transformer_rows}, not {expected}")
    else:
        expect(served.transformer_rows == told.transformer_rows == expected,
               f"transformer rows: computed {served.transformer_rows}, told {told.transformer_rows}, expected {expected}")


# Kept counterexamples: each found a defect once, and runs first in the test and the benchmark.
def _regression(copy_name: str, body: dict[str, Any], **how) -> Case:
    fields = dict(dtype="float32", lora=False, micro_batch_size=4, invariance="padding", chunk_size=8)
    return Case(copy=copy_name, body=body, **{**fields, **how})


_TRAJECTORY = {"rollout_return_dit_trajectory": True}
REGRESSIONS = (
    # Issue 44: a branch at step 0 kept x_0 twice, so x_1 was a buffer nobody wrote.
    _regression(EMBEDDED_MODEL, {"prompt": "3", "seed": 84603, "num_inference_steps": 2, "num_outputs_per_prompt": 2,
                                   "rollout_branch_steps": [0], "rollout_branch_factors": [2], **_TRAJECTORY}),
    _regression(EMBEDDED_MODEL, {"prompt": ["3", "7"], "seed": 5, "num_inference_steps": 6, "num_outputs_per_prompt": 4,
                                   "rollout_branch_steps": [0, 5], "rollout_branch_factors": [2, 2], "rollout_debug_mode": True,
                                   **_TRAJECTORY}),
    _regression(EMBEDDED_MODEL, {"prompt": "1", "seed": 7, "num_inference_steps": 4, "num_outputs_per_prompt": 4,
                                   "rollout_sde_type": "cps", "rollout_branch_steps": [0, 1], "rollout_branch_factors": [2, 2],
                                   **_TRAJECTORY}),
    _regression(EMBEDDED_MODEL, {"prompt": "8", "seed": 11, "num_inference_steps": 6, "num_outputs_per_prompt": 8,
                                   "rollout_branch_steps": [0, 3], "rollout_branch_factors": [2, 2],
                                   "rollout_return_step_indices": [0, 1, 4, 6]}, companions=(("2", 3, Branching(), ()),)),
    # Split noise of scale 1 with the nominal std: the tree read back from a dataset had the default std.
    _regression(EMBEDDED_MODEL, {"prompt": "3", "seed": 0, "num_inference_steps": 1, "num_outputs_per_prompt": 2,
                                   "rollout_branch_steps": [0], "rollout_branch_factors": [2],
                                   "rollout_branch_noise_scales": [1], "rollout_branch_log_prob_std": "nominal"}),
    # CPS at eta 0.99999: the mean's sqrt of a difference of near-equal squares, within fp32's rounding
    # of them, was held to a relative 1e-5 (the check's tolerance, not the step, was wrong).
    _regression("sd3", {"prompt": ["a cat"], "seed": MAX_SEED, "num_inference_steps": 4, "rollout_sde_type": "cps",
                        "rollout_noise_level": 0.99999, "rollout_debug_mode": False, "num_outputs_per_prompt": 1},
                micro_batch_size=1, chunk_size=1),
    # Split noise scaled by 0.5 with the scaled std: the check scored it with the step's own std.
    _regression("ltx", {"prompt": ["a cat"], "seed": 0, "num_inference_steps": 2, "height": 32, "width": 32, "num_frames": 9,
                        "rollout_noise_level": 1.0, "rollout_debug_mode": False, "rollout_branch_steps": [0, 1],
                        "rollout_branch_factors": [2, 2], "rollout_branch_noise_scales": [1, 0.5],
                        "rollout_branch_log_prob_std": "scaled", "num_outputs_per_prompt": 4},
                micro_batch_size=1, chunk_size=1),
    # Qwen-Image-Edit's prompts in two text buckets: the checker held the rows of its calls apart to
    # the rows told, as it did for Qwen-Image's alone (the cost's one approximation: rollout/cost.py).
    _regression("qwenimage_edit", {"prompt": ["a cat", "two dogs on the grass at night"], "seed": 0, "num_inference_steps": 2,
                                   "image_path": [_png_data_uri(16, 16, 0), _png_data_uri(16, 16, 1)], "height": 32,
                                   "width": 32, "rollout_debug_mode": False, "num_outputs_per_prompt": 1}),
    # A served LoRA on Wan at 1 frame: the second sample of a padded call of 2 got other bits than
    # alone. Once open, it holds with the dependencies a fresh setup installed on
    # 2026-12-07 (diffusers 0.42.1, peft 0.21.2, transformers 5.25.0, torch 2.13.0), which changed
    # nothing of ours (ddaa002, where it was open, passes with them too): the cause is unknown;
    # kept, to catch its return.
    _regression("wan21", {"prompt": ["a cat", "a cat"], "seed": 0, "num_inference_steps": 1, "height": 16, "width": 16,
                        "num_frames": 1, "rollout_noise_level": 0.0, "num_outputs_per_prompt": 1},
                lora=True, micro_batch_size=2, chunk_size=1),
    # A served LoRA under batch-invariant kernels: a sample sliced from a call kept the call's strides.
    _regression("sd3", {"prompt": ["a cat"], "seed": 0, "num_inference_steps": 2, "height": 32, "width": 32,
                        "num_outputs_per_prompt": 1, "rollout_return_step_indices": [0, 1, 2]},
                lora=True, invariance="kernels", micro_batch_size=2, companions=(("a cat", 0, Branching(), ()),)),
    # One prompt with its image, not a list: the checker resumed it as a list of one prompt with the
    # image alone, which the request refuses (the checker's defect, not the server's).
    _regression("flux2", {"prompt": "a cat", "image_path": _png_data_uri(72, 136, 0), "seed": MAX_SEED, "num_inference_steps": 1,
                          "height": 32, "width": 32, "rollout_noise_level": 0.0, "rollout_return_step_indices": [0],
                          "rollout_debug_mode": False, "num_outputs_per_prompt": 1},
                micro_batch_size=1, chunk_size=1),
)

# Counterexamples whose defect is still open: each still breaks a guarantee (the suite holds it so
# with a strict xfail, which fails the day the defect is fixed, so it moves to REGRESSIONS).
OPEN_COUNTEREXAMPLES: tuple[Case, ...] = ()


def run(examples: int, hypothesis_seed: int, copies: tuple[str, ...]) -> dict[str, Any]:
    """Checks the kept counterexamples, then `examples` generated cases; raises on the first
    violation (Hypothesis shrinks it first)."""
    counts: dict[str, int] = {}
    started = time.perf_counter()
    for case in REGRESSIONS:
        check_case(case)

    @seed(hypothesis_seed)
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(cases(copies))
    def generated(case: Case) -> None:
        check_case(case)
        key = case.copy + (f" {case.body.get('rollout_branch_shape', 'tree')}" if "rollout_branch_steps" in case.body else "")
        counts[key] = counts.get(key, 0) + 1
        done = sum(counts.values())
        if done % 100 == 0:
            print(f"  {done} requests checked, {time.perf_counter() - started:.0f} s", flush=True)

    generated()
    return {"cases": counts, "regressions": len(REGRESSIONS), "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=200, help="generated requests to check")
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis's seed: the same seed draws the same requests")
    parser.add_argument(
        "--models", nargs="+", default=list(COPIES), choices=list(COPIES), help="the tiny copies to draw requests for"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch's CPU threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"checking {args.examples} generated requests (seed {args.seed}) on {', '.join(args.models)}", flush=True)
    result = run(args.examples, args.seed, tuple(args.models))
    total = sum(result["cases"].values())
    print(f"{total} requests checked (plus {result['regressions']} kept counterexamples) in {result['seconds']:.0f} s: 0 violations")
    for key, count in sorted(result["cases"].items()):
        print(f"  {key}: {count}")


if __name__ == "__main__":
    main()
