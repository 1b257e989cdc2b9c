"""The model families as the tests, the benchmarks and `scripts/gpu_check.py` know them: one record
per tiny copy, holding how to build it and every per-family setting they read. Each parametrised
test, benchmark and the GPU check iterates over `TINY_FAMILIES` or a filter of it (`IMAGE_FAMILIES`,
`VIDEO_FAMILIES`, the records with `requests` or `gpu_check`), so adding a family is its model file
in `rollout/models/` and one record here, with its builder in `rollout.testing.builders`.

Importing this module imports the family classes (diffusers), not the builders (transformers'
text encoders): `TinyFamily.build` imports those where a copy is built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from rollout.models.digits import DigitFlowPipeline
from rollout.models.flux import FluxFamily
from rollout.models.flux2 import Flux2Family
from rollout.models.flux_kontext import FluxKontextFamily
from rollout.models.ltx import LTXVideoFamily
from rollout.models.qwenimage import QwenImageFamily
from rollout.models.qwenimage_edit import QwenImageEditFamily
from rollout.models.sd3 import StableDiffusion3Family
from rollout.models.wan import WanFamily
from rollout.models.wan_i2v import WanImageToVideoFamily

DIGIT_PROMPTS = ("0", "3", "seven", "a handwritten 4", "the digit 9")  # the embedded model knows only digits
WORDS = ("a cat", "a red house", "two dogs on the grass at night", "x")


@dataclass(frozen=True)
class RequestSpace:
    """The part of the request space `benchmarks.properties` draws a model's requests from.

    Attributes:
        prompts: prompts the model accepts.
        sizes: heights and widths to draw from (None: the model's default). Given where the
            family's default is the real model's (1024 px, 81 frames): small enough that a case
            takes seconds on a CPU.
        frames: frame counts to draw from (None: the model's default).
        guidance_scales, true_cfg_scales: what to draw for the two guidance fields.
        dtypes: the dtypes it is loaded in.
        min_steps: the fewest steps a request asks for (a scheduler stretched to a terminal sigma
            makes no finite schedule of 1 step: a 400 naming num_inference_steps).
        image_sizes: `(height, width)` of the input image each prompt is sent (`image_path`) to
            draw from; None: no image (an editing model's text-to-image request).
        budget: generated requests a test run checks (`tests/test_request_properties.py`): under
            two minutes in all on 2 cores, a family's case costing several of the embedded model's.
    """

    prompts: tuple[str, ...]
    budget: int
    sizes: tuple[int | None, ...] = (None,)
    frames: tuple[int | None, ...] = (None,)
    guidance_scales: tuple[float | None, ...] = (None,)
    true_cfg_scales: tuple[float | None, ...] = (None,)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    min_steps: int = 1
    image_sizes: tuple[tuple[int, int] | None, ...] = (None,)


@dataclass(frozen=True)
class GpuCheck:
    """How `scripts/gpu_check.py` runs a family at its published size.

    Attributes:
        published: the function of `rollout.testing.published` that builds the published model.
        budget_weight: the family's share of the time left, against the others' (SD3.5-Medium's
            is 1; FLUX.1-dev's transformer is 5x its, which runs two rows a sample for CFG).
    """

    published: str
    budget_weight: float

    def build(self, tiny_pipe):
        """The published model on the tiny copy's tokenizers and scheduler, built in the default
        dtype on the default device."""
        from rollout.testing import published

        return getattr(published, self.published)(tiny_pipe)


@dataclass(frozen=True)
class TransformerInputs:
    """What the family's transformer takes besides the latents and the time, as a sample's
    `denoising_env` returns it (SGLang's layout), and the time input it is given.

    Attributes:
        per_branch: the inputs of each guidance branch (`pos_cond_kwargs`, `neg_cond_kwargs`).
        image: the image inputs (`image_kwargs`: positions, shapes); empty where there are none.
        guidance: whether the model takes an embedded guidance input (FLUX.1-dev's).
        time_per_1000: whether the time input is the scheduler's timesteps in the model's dtype
            over 1000 (as the family's diffusers pipeline passes it) rather than the timesteps.
    """

    per_branch: frozenset[str]
    image: frozenset[str] = frozenset()
    guidance: bool = False
    time_per_1000: bool = False


@dataclass(frozen=True)
class TinyFamily:
    """A tiny copy of a family and the settings the tests, benchmarks and GPU check run it with.

    Attributes:
        name: the copy's name: test ids, fixture keys and directory names. An image family has
            one copy, named as its model (tests load it by that name).
        family: the runtime class (`rollout.models`) that serves it; its `name` is the model the
            registry loads the copy as (Wan's three layouts are all model `wan`).
        builder: the function of `rollout.testing.builders` that saves the copy; None: the
            embedded model, loaded from its packaged weights.
        guided, unguided: `SamplingOptions` fields, the same as the diffusers pipeline's
            arguments, that turn classifier-free guidance on and off (None: the embedded model's
            tests choose their own).
        trained: the guidance the published model samples with in training (Flow-GRPO's, or the
            pipeline's default): what the GPU check and `benchmarks.bf16_paths` run.
        frames: the frames of the tests' small videos; 1 for an image family (`video` is False).
        token_pixels: the pixels a side of one transformer token (VAE factor x patch): sizes
            must be multiples of it.
        tiled_size: a (height, width) above the VAE's tile size, where a decode cuts tiles and
            blends them (None: the tiling test leaves the copy out).
        throughput_steps: the steps `benchmarks.throughput` times the family at (None: not timed).
        inputs: what its transformer takes (None: not checked for the copy).
        requests: what `benchmarks.properties` draws for the model (None: another copy of the same
            model stands for it).
        gpu_check: how `scripts/gpu_check.py` runs it at its published size (None: it does not).
        condition_images: input images per prompt its tests send (0: a text-to-image or
            text-to-video model); such a copy is tested by `tests/test_image_conditioned.py`, not
            with the text-to-image families.
        pipeline_arguments: `(image, height, width) -> kwargs`: what the family's diffusers
            pipeline is given for an input image (a PIL image) and the request's output size,
            besides the prompts, steps, generators and guidance (None: a model without images).
        image_pipeline: the diffusers pipeline class that conditions the copy on an image where
            its directory's own does not take one (made from it with `from_pipe`, as diffusers'
            users do); None: the directory's own.
    """

    name: str
    family: type
    builder: str | None
    guided: Mapping[str, Any] | None = None
    unguided: Mapping[str, Any] | None = None
    trained: Mapping[str, Any] | None = None
    frames: int = 1
    token_pixels: int = 16
    tiled_size: tuple[int, int] | None = None
    throughput_steps: int | None = None
    inputs: TransformerInputs | None = None
    requests: RequestSpace | None = None
    gpu_check: GpuCheck | None = None
    condition_images: int = 0
    pipeline_arguments: Callable[[Any, int, int], dict[str, Any]] | None = None
    image_pipeline: str | None = None

    @property
    def model(self) -> str:
        """The registry's name of the model (`rollout.models.registry.load_pipeline`)."""
        return self.family.name

    @property
    def embedded(self) -> bool:
        return self.builder is None

    @property
    def video(self) -> bool:
        return self.frames > 1

    @property
    def rows_per_guided_sample(self) -> int:
        """Rows a guided sample takes in a transformer call: 2 where the family runs both branches in one call."""
        return 2 if self.family.batches_guidance_branches else 1

    def build(self, path: Path, **widths: Any) -> Path:
        """Saves the tiny copy to `path` and returns it; `widths`: the builder's own (`transformer_heads`)."""
        from rollout.testing import builders  # imports transformers: only where a copy is built

        return getattr(builders, self.builder)(path, **widths)


_WAN22_TI2V = TinyFamily(
    "wan22_ti2v",
    WanFamily,
    "build_tiny_wan22_ti2v",
    guided={"guidance_scale": 4.0},
    unguided={"guidance_scale": 1.0},
    frames=5,
    token_pixels=32,  # the Wan2.2 VAE's factor 16
)
TINY_FAMILIES: dict[str, TinyFamily] = {
    record.name: record
    for record in (
        TinyFamily(
            "embedded-digits",
            DigitFlowPipeline,
            builder=None,
            requests=RequestSpace(
                DIGIT_PROMPTS, budget=30, guidance_scales=(None, 0.0, 1.0, 2.5), true_cfg_scales=(None, 1.5)
            ),
        ),
        TinyFamily(
            "sd3",
            StableDiffusion3Family,
            "build_tiny_sd3",
            guided={"guidance_scale": 4.5},
            unguided={"guidance_scale": 1.0},
            trained={"guidance_scale": 4.5},
            throughput_steps=28,
            inputs=TransformerInputs(frozenset({"encoder_hidden_states", "pooled_projections"})),
            requests=RequestSpace(WORDS, budget=4, sizes=(None, 32), guidance_scales=(None, 1.0, 4.5)),
            gpu_check=GpuCheck("sd35_medium", budget_weight=1.0),
        ),
        TinyFamily(
            "flux",
            FluxFamily,
            "build_tiny_flux",
            guided={"true_cfg_scale": 2.5},
            unguided={"guidance_scale": 3.5},  # FLUX.1-dev's embedded guidance, no CFG
            trained={"guidance_scale": 3.5},
            throughput_steps=28,
            inputs=TransformerInputs(
                frozenset({"encoder_hidden_states", "pooled_projections", "txt_ids"}),
                image=frozenset({"img_ids"}),
                guidance=True,
                time_per_1000=True,
            ),
            requests=RequestSpace(
                WORDS, budget=4, sizes=(32, 48), guidance_scales=(None, 3.5), true_cfg_scales=(None, 1.0, 2.0)
            ),
            gpu_check=GpuCheck("flux1_dev", budget_weight=1.6),
        ),
        TinyFamily(
            "flux_kontext",
            FluxKontextFamily,
            "build_tiny_flux_kontext",
            guided={"true_cfg_scale": 2.5},
            unguided={"guidance_scale": 2.5},  # FLUX.1-Kontext-dev's embedded guidance, no CFG
            trained={"guidance_scale": 2.5},
            inputs=TransformerInputs(
                frozenset({"encoder_hidden_states", "pooled_projections", "txt_ids"}),
                image=frozenset({"img_ids", "condition_latents", "condition_ids"}),
                guidance=True,
                time_per_1000=True,
            ),
            requests=RequestSpace(
                WORDS,
                budget=1,  # a megapixel condition makes a case cost seconds: the campaign runs more
                sizes=(32,),
                guidance_scales=(None, 2.5),
                true_cfg_scales=(None, 2.0),
                image_sizes=((40, 72), (64, 24), None),  # an image first: Hypothesis draws it first
            ),
            condition_images=1,
            # The request's size is the output size: the pipeline's with max_area = height x width.
            pipeline_arguments=lambda image, height, width: {"image": image, "max_area": height * width},
            gpu_check=GpuCheck("flux1_kontext_dev", budget_weight=1.6),
        ),
        TinyFamily(
            "flux2",
            Flux2Family,
            "build_tiny_flux2",
            # No classifier-free guidance in FLUX.2's pipeline: "guided" is its embedded guidance at
            # the pipeline's default, "unguided" at 1.
            guided={"guidance_scale": 4.0},
            unguided={"guidance_scale": 1.0},
            trained={"guidance_scale": 4.0},
            inputs=TransformerInputs(
                frozenset({"encoder_hidden_states", "txt_ids"}),
                image=frozenset({"img_ids", "condition_latents", "condition_ids"}),
                guidance=True,
                time_per_1000=True,
            ),
            requests=RequestSpace(
                WORDS, budget=2, sizes=(32,), guidance_scales=(None, 1.0, 4.0), image_sizes=((72, 136), None)
            ),
            token_pixels=16,  # the VAE's 8 x the 2x2 patch
            condition_images=1,
            # The request's size is the output size; the image is a reference (rollout/models/flux2.py).
            pipeline_arguments=lambda image, height, width: {"image": [image]},
        ),
        TinyFamily(
            "qwenimage",
            QwenImageFamily,
            "build_tiny_qwenimage",
            guided={"true_cfg_scale": 4.0},
            unguided={"true_cfg_scale": 1.0},
            trained={"true_cfg_scale": 4.0},
            throughput_steps=10,
            inputs=TransformerInputs(
                frozenset({"encoder_hidden_states", "encoder_hidden_states_mask"}),
                image=frozenset({"img_shapes"}),
                time_per_1000=True,
            ),
            requests=RequestSpace(WORDS, budget=4, sizes=(32, 48), true_cfg_scales=(None, 1.0, 3.0), min_steps=2),
        ),
        TinyFamily(
            "qwenimage_edit",
            QwenImageEditFamily,
            "build_tiny_qwenimage_edit",
            guided={"true_cfg_scale": 4.0},
            unguided={"true_cfg_scale": 1.0},
            trained={"true_cfg_scale": 4.0},
            inputs=TransformerInputs(
                frozenset({"encoder_hidden_states", "encoder_hidden_states_mask"}),
                image=frozenset({"img_shapes", "condition_latents_1"}),
                time_per_1000=True,
            ),
            requests=RequestSpace(
                WORDS, budget=1, sizes=(32,), true_cfg_scales=(None, 1.0, 3.0), min_steps=2, image_sizes=((72, 136), None)
            ),
            condition_images=1,
            # The request's size is the output size; the condition is about 1 MP whatever it is.
            pipeline_arguments=lambda image, height, width: {"image": image},
            gpu_check=GpuCheck("qwen_image_edit", budget_weight=2.0),
        ),
        TinyFamily(
            "wan21",
            WanFamily,
            "build_tiny_wan21",
            guided={"guidance_scale": 4.0},
            unguided={"guidance_scale": 1.0},
            trained={"guidance_scale": 5.0},
            frames=5,  # two of Wan's latent frames
            tiled_size=(288, 320),  # Wan's VAE tiles 256 px
            requests=RequestSpace(WORDS, budget=3, sizes=(16, 32), frames=(1, 5), guidance_scales=(None, 1.0, 5.0)),
            # Two videos timed, with no calibration or batch sizes.
            gpu_check=GpuCheck("wan21_t2v_1_3b", budget_weight=0.6),
        ),
        TinyFamily(
            "wan22_a14b",
            WanFamily,
            "build_tiny_wan22_a14b",
            guided={"guidance_scale": 4.0, "guidance_scale_2": 2.5},  # the low-noise expert's own scale
            unguided={"guidance_scale": 1.0},
            frames=5,
        ),
        _WAN22_TI2V,
        dataclasses.replace(
            # The same TI2V copy, its prompts given images: latent frame 0 held (rollout/models/wan.py).
            _WAN22_TI2V,
            name="wan22_ti2v_image",
            requests=RequestSpace(
                WORDS,
                budget=2,
                sizes=(32, 64),  # 64: frames of several tokens
                frames=(5, 9),  # a video given its first frame samples at least one latent frame after it
                guidance_scales=(None, 1.0, 4.0),
                image_sizes=((40, 72), None),  # with and without an image: one model serves both
            ),
            inputs=TransformerInputs(frozenset({"encoder_hidden_states"}), image=frozenset({"first_frame_latents"})),
            condition_images=1,
            pipeline_arguments=lambda image, height, width: {"image": image},
            image_pipeline="WanImageToVideoPipeline",
        ),
        TinyFamily(
            "wan21_i2v",
            WanImageToVideoFamily,
            "build_tiny_wan21_i2v",
            guided={"guidance_scale": 4.0},
            unguided={"guidance_scale": 1.0},
            trained={"guidance_scale": 5.0},
            frames=5,
            inputs=TransformerInputs(
                frozenset({"encoder_hidden_states"}),
                image=frozenset({"condition_mask", "condition_latents", "encoder_hidden_states_image"}),
            ),
            requests=RequestSpace(
                WORDS,
                budget=2,
                sizes=(32,),
                frames=(1, 5),
                guidance_scales=(None, 1.0, 4.0),
                image_sizes=((40, 72), (64, 24)),  # image-to-video needs its image
            ),
            condition_images=1,
            # The image is stretched to the output size (rollout/models/wan_i2v.py).
            pipeline_arguments=lambda image, height, width: {"image": image},
        ),
        TinyFamily(
            "wan22_i2v_a14b",
            WanImageToVideoFamily,
            "build_tiny_wan22_i2v_a14b",
            guided={"guidance_scale": 4.0, "guidance_scale_2": 2.5},  # the low-noise expert's own scale
            unguided={"guidance_scale": 1.0},
            frames=5,
            inputs=TransformerInputs(
                frozenset({"encoder_hidden_states"}), image=frozenset({"condition_mask", "condition_latents"})
            ),
            condition_images=1,
            pipeline_arguments=lambda image, height, width: {"image": image},
        ),
        TinyFamily(
            "ltx",
            LTXVideoFamily,
            "build_tiny_ltx",
            guided={"guidance_scale": 3.0},
            unguided={"guidance_scale": 1.0},
            frames=9,  # two of LTX-Video's latent frames (8 frames each)
            token_pixels=32,
            tiled_size=(544, 544),  # LTX-Video's VAE tiles 512 px
            requests=RequestSpace(
                WORDS, budget=3, sizes=(32,), frames=(9,), guidance_scales=(None, 1.0, 3.0), min_steps=2
            ),
        ),
    )
}
# The names of the copies of real image families and of video families: what the tests' fixtures build.
IMAGE_FAMILIES = [
    name
    for name, record in TINY_FAMILIES.items()
    if not record.video and not record.embedded and not record.condition_images
]
# The copies of image-conditioned families (editing, image-to-video).
CONDITIONED_FAMILIES = [name for name, record in TINY_FAMILIES.items() if record.condition_images]
# The copies of text-to-video families (image-to-video ones are conditioned).
VIDEO_FAMILIES = [name for name, record in TINY_FAMILIES.items() if record.video and not record.condition_images]
