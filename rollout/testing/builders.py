"""Tiny, random-weight, fully offline copies of real diffusers pipeline families: what the tests,
`scripts/gpu_check.py` and the benchmarks build the real families from (each family's builder
is named by its record in `rollout.testing.families`).

Each builder assembles a pipeline from the real model classes with tiny widths and depths but the
real shapes and configs a sampler depends on (16 latent channels, VAE scale factor 8, SD3 patch 2,
FLUX/Qwen 2x2 packing, the real VAE scaling/shift, the real scheduler configs), then saves it with
`save_pretrained`, so that tests can load it with `<Pipeline>.from_pretrained(path)` like a hub
checkpoint. Tokenizers are made in code (`rollout.testing.tokenizers`), so nothing is downloaded.
Every component is built after `torch.manual_seed`, so two builds write byte-identical weights.
`build_tiny_clip` does the same for a scorer's checkpoint, a transformers `CLIPModel` with its processor.

    path = build_tiny_flux(tmp_path / "flux")
    pipe = FluxPipeline.from_pretrained(path)
"""

import json
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLLTXVideo,
    AutoencoderKLQwenImage,
    AutoencoderKLWan,
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2Pipeline,
    Flux2Transformer2DModel,
    FluxKontextPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
    LTXPipeline,
    LTXVideoTransformer3DModel,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    UniPCMultistepScheduler,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from transformers import (
    CLIPConfig,
    CLIPImageProcessor,
    CLIPModel,
    CLIPProcessor,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    CLIPVisionConfig,
    CLIPVisionModel,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
    UMT5Config,
    UMT5EncoderModel,
)

from rollout.testing.tokenizers import tiny_clip_tokenizer, tiny_qwen2_tokenizer, tiny_t5_tokenizer

_SEED = 0

_LATENT_CHANNELS = 16
# Four VAE blocks: the pipelines derive their VAE scale factor as 2 ** (len(blocks) - 1) = 8.
_VAE_BLOCKS = 4

_SD3_SCHEDULER = {"shift": 3.0}
_FLUX_SCHEDULER = {
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "shift": 3.0,
}
_QWEN_SCHEDULER = {
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "shift": 1.0,
}
# The Wan 2.1 VAE statistics that Qwen-Image's VAE config carries, per latent channel.
_QWEN_LATENTS_MEAN = [
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
]  # fmt: skip
_QWEN_LATENTS_STD = [
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
]  # fmt: skip

# The Wan2.2 VAE's (TI2V-5B: 48 latent channels, spatial factor 16) per-channel statistics, as
# diffusers' conversion script writes them.
_WAN22_LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
]  # fmt: skip
_WAN22_LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
]  # fmt: skip


# --- Model components -------------------------------------------------------------------------


def _clip_text_encoder(
    model_class: type[CLIPTextModel | CLIPTextModelWithProjection],
    tokenizer: CLIPTokenizer,
    hidden_size: int,
    hidden_act: str,
) -> CLIPTextModel | CLIPTextModelWithProjection:
    torch.manual_seed(_SEED)
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        projection_dim=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=tokenizer.model_max_length,
        hidden_act=hidden_act,
        # The pooled output is read at the first end-of-text token, found by this id.
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model_class(config)


def _t5_encoder(tokenizer: T5TokenizerFast, d_model: int, umt5: bool = False) -> T5EncoderModel | UMT5EncoderModel:
    """A T5 v1.1 encoder (SD3's and FLUX's), or with `umt5` Wan's UMT5 (the same layout with a
    relative attention bias in every layer)."""
    torch.manual_seed(_SEED)
    config_class, model_class = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    config = config_class(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=16,
        d_ff=2 * d_model,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",  # T5 v1.1, as in SD3 and FLUX
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return model_class(config)


def _vae(scaling_factor: float, shift_factor: float) -> AutoencoderKL:
    """The SD3/FLUX VAE layout (16 latent channels, scale factor 8) with tiny widths."""
    torch.manual_seed(_SEED)
    return AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * _VAE_BLOCKS,
        up_block_types=("UpDecoderBlock2D",) * _VAE_BLOCKS,
        block_out_channels=(8, 16, 16, 16),
        norm_num_groups=8,
        latent_channels=_LATENT_CHANNELS,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        # SD3 and FLUX VAEs have no quant convs.
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


# --- Families ---------------------------------------------------------------------------------


def build_tiny_sd3(path: Path, transformer_heads: int = 2) -> Path:
    """Save a tiny SD3.5-like `StableDiffusion3Pipeline` to `path` and return `path`.

    CLIP-L (hidden 32) and CLIP-G (hidden 48) `CLIPTextModelWithProjection`s, a T5 encoder of width
    96 (>= 32 + 48, the CLIP features are zero-padded to it), an `SD3Transformer2DModel` with two
    layers, the first with SD3.5's dual attention and RMS qk-norm, patch 2, default size 64 px and
    positional embeddings for up to 512 px; `AutoencoderKL` (scaling 1.5305, shift 0.0609) and the
    static shift-3 flow-matching scheduler.
    """
    clip_tokenizer = tiny_clip_tokenizer()
    # SD3's second CLIP tokenizer (from OpenCLIP bigG) pads with "!", not with end-of-text.
    clip_tokenizer_2 = tiny_clip_tokenizer(pad_token="!")
    t5_tokenizer = tiny_t5_tokenizer()
    text_encoder = _clip_text_encoder(CLIPTextModelWithProjection, clip_tokenizer, 32, "quick_gelu")
    text_encoder_2 = _clip_text_encoder(CLIPTextModelWithProjection, clip_tokenizer_2, 48, "gelu")
    text_encoder_3 = _t5_encoder(t5_tokenizer, d_model=96)
    torch.manual_seed(_SEED)
    transformer = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=transformer_heads,
        joint_attention_dim=text_encoder_3.config.d_model,
        caption_projection_dim=16 * transformer_heads,  # the transformer's width, heads * head dim
        pooled_projection_dim=text_encoder.config.projection_dim + text_encoder_2.config.projection_dim,
        pos_embed_max_size=32,
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**_SD3_SCHEDULER),
        vae=_vae(scaling_factor=1.5305, shift_factor=0.0609),
        text_encoder=text_encoder,
        tokenizer=clip_tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=clip_tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=t5_tokenizer,
    )
    pipe.save_pretrained(path)
    return path


def build_tiny_flux(
    path: Path, guidance_embeds: bool = True, transformer_heads: int = 2, pipeline_class: type = FluxPipeline
) -> Path:
    """Save a tiny FLUX.1-like `FluxPipeline` to `path` and return `path`.

    CLIP-L `CLIPTextModel` (hidden 32, its pooled output conditions the transformer), a T5 encoder
    of width 64, a `FluxTransformer2DModel` with one double- and one single-stream block on 2x2
    packed latents (in_channels 64), with guidance embedding as FLUX.1-dev unless
    `guidance_embeds=False` (FLUX.1-schnell-like); `AutoencoderKL` (scaling 0.3611, shift 0.1159)
    and FLUX.1-dev's resolution-dependent (dynamic shift) scheduler.
    """
    clip_tokenizer = tiny_clip_tokenizer()
    t5_tokenizer = tiny_t5_tokenizer()
    text_encoder = _clip_text_encoder(CLIPTextModel, clip_tokenizer, 32, "quick_gelu")
    text_encoder_2 = _t5_encoder(t5_tokenizer, d_model=64)
    torch.manual_seed(_SEED)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * _LATENT_CHANNELS,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=transformer_heads,
        joint_attention_dim=text_encoder_2.config.d_model,
        pooled_projection_dim=text_encoder.config.hidden_size,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 6, 6),  # sums to the head dim, like (16, 56, 56) for 128
    )
    pipe = pipeline_class(
        scheduler=FlowMatchEulerDiscreteScheduler(**_FLUX_SCHEDULER),
        vae=_vae(scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=text_encoder,
        tokenizer=clip_tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(path)
    return path


def build_tiny_flux_kontext(path: Path, transformer_heads: int = 2) -> Path:
    """Save a tiny FLUX.1-Kontext-dev-like `FluxKontextPipeline` to `path` and return `path`: the
    components of `build_tiny_flux` (Kontext-dev is FLUX.1-dev's architecture, guidance embedded)."""
    return build_tiny_flux(path, transformer_heads=transformer_heads, pipeline_class=FluxKontextPipeline)


# FLUX.2-dev's published scheduler config: dynamic shifting, whose `mu` the pipeline computes itself
# (`compute_empirical_mu`), so only the flag and the exponential time shift matter.
_FLUX2_SCHEDULER = {
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "shift": 3.0,
    "time_shift_type": "exponential",
}
# A chat template over list-of-parts content (what `Flux2Pipeline`'s `format_input` makes), text parts only.
_FLUX2_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
    "{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
)


def build_tiny_flux2(path: Path, transformer_heads: int = 2) -> Path:
    """Save a tiny FLUX.2-dev-like `Flux2Pipeline` to `path` and return `path`.

    A `Mistral3ForConditionalGeneration` text encoder (a Mistral text model of width 16 and 30 layers,
    since the pipeline stacks hidden states 10, 20 and 30; a one-layer Pixtral vision tower) on the
    tiny Qwen2 tokenizer with a chat template over list-of-parts content, a `Flux2Transformer2DModel`
    with one double- and one single-stream block on 2x2-patchified latents (in_channels 32: 8 latent
    channels x 4) with embedded guidance and 4-axis RoPE ids, an `AutoencoderKLFlux2` (VAE factor 8)
    whose BatchNorm running statistics are set away from (0, 1), and FLUX.2-dev's scheduler config.
    """
    tokenizer = tiny_qwen2_tokenizer()
    tokenizer.chat_template = _FLUX2_CHAT_TEMPLATE
    text_width, latent_channels = 16, 8
    torch.manual_seed(_SEED)
    config = Mistral3Config(
        text_config={
            "model_type": "mistral",
            "vocab_size": len(tokenizer),
            "hidden_size": text_width,
            "intermediate_size": 32,
            "num_hidden_layers": 30,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "max_position_embeddings": 2048,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "head_dim": 8,
            "image_size": 64,
            "patch_size": 8,
        },
        image_token_index=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
    )
    text_encoder = Mistral3ForConditionalGeneration(config)
    torch.manual_seed(_SEED)
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * latent_channels,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=transformer_heads,
        joint_attention_dim=3 * text_width,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),  # sums to the head dim, like (32, 32, 32, 32) for 128
    )
    torch.manual_seed(_SEED)
    vae = AutoencoderKLFlux2(
        block_out_channels=(8,) * _VAE_BLOCKS, layers_per_block=1, latent_channels=latent_channels, norm_num_groups=4
    )
    # The latents' normalisation statistics (of the 2x2-patchified channels): not the identity.
    vae.bn.running_mean.copy_(0.1 * torch.randn_like(vae.bn.running_mean))
    vae.bn.running_var.copy_(0.5 + torch.rand_like(vae.bn.running_var))
    pipe = Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**_FLUX2_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(path)
    return path


def build_tiny_qwenimage(path: Path, transformer_heads: int = 2) -> Path:
    """Save a tiny Qwen-Image-like `QwenImagePipeline` to `path` and return `path`.

    A `Qwen2_5_VLForConditionalGeneration` text encoder (text width 32, multimodal RoPE, a one-block
    vision tower), a `QwenImageTransformer2DModel` with one block on 2x2 packed latents, an
    `AutoencoderKLQwenImage` with Qwen-Image's per-channel latent mean/std and the scheduler config
    of Qwen-Image (dynamic exponential shift, terminal sigma 0.02).

    The pipeline drops a fixed number of leading tokens (its chat template's system prefix) from
    the text encoder's output; the tokenizer is made so that the prefix has exactly that length,
    which is checked here.
    """
    tokenizer = tiny_qwen2_tokenizer()
    pipe = QwenImagePipeline(**_qwenimage_components(tokenizer, transformer_heads))
    _check_system_prefix(pipe, tokenizer)
    pipe.save_pretrained(path)
    return path


def _qwenimage_components(tokenizer, transformer_heads: int, vae_width: int = 8) -> dict:
    """Qwen-Image's text encoder (on `tokenizer`), transformer, VAE (`vae_width` channels at full
    resolution) and scheduler, tiny."""
    text_width = 32
    torch.manual_seed(_SEED)
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": text_width,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 2048,
            # Multimodal RoPE: temporal, height and width sections of the head dim's 8 rotary
            # frequencies (transformers files Qwen's "mrope" type under "default").
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
            "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": text_width,
            "fullatt_block_indexes": [0],
        },
        # The defaults are ids in Qwen's 151k vocabulary: point them at this tokenizer's tokens.
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    torch.manual_seed(_SEED)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * _LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        num_layers=1,
        attention_head_dim=16,
        num_attention_heads=transformer_heads,
        joint_attention_dim=text_width,
        axes_dims_rope=(4, 6, 6),  # sums to the head dim, like (16, 56, 56) for 128
    )
    torch.manual_seed(_SEED)
    vae = AutoencoderKLQwenImage(
        base_dim=vae_width,
        z_dim=_LATENT_CHANNELS,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        # Three spatial downsamplings: the pipeline's VAE scale factor is 2 ** 3 = 8.
        temperal_downsample=[False, True, True],
        latents_mean=_QWEN_LATENTS_MEAN,
        latents_std=_QWEN_LATENTS_STD,
    )
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(**_QWEN_SCHEDULER),
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer": transformer,
    }


def _check_system_prefix(pipe, tokenizer) -> None:
    """The pipeline drops a fixed number of leading tokens (its chat template's system prefix, up to
    the user's turn); raises unless the tiny tokenizer makes the prefix exactly that long."""
    prefix = pipe.prompt_template_encode.split("{}")[0]
    prefix = prefix[: prefix.index("user\n") + len("user\n")]  # an Edit template's image tokens follow
    prefix_length = len(tokenizer(prefix).input_ids)
    if prefix_length != pipe.prompt_template_encode_start_idx:
        raise RuntimeError(
            f"{type(pipe).__name__}'s system prefix is {prefix_length} tokens with the tiny tokenizer, but the "
            f"pipeline drops {pipe.prompt_template_encode_start_idx}: the prompt embeddings would be cut wrongly"
        )


def build_tiny_qwenimage_edit(
    path: Path, transformer_heads: int = 2, pipeline_class: type = QwenImageEditPipeline
) -> Path:
    """Save a tiny Qwen-Image-Edit-like `QwenImageEditPipeline` (or `pipeline_class`:
    `QwenImageEditPlusPipeline`) to `path` and return `path`: the components of
    `build_tiny_qwenimage` on a tokenizer learnt on the Edit template (whose 64-token system prefix
    the pipeline drops), and a Qwen2-VL processor whose image processor makes at most 16 vision
    tokens an image (the real one's 1 MP condition makes about 1400).

    `Qwen2VLProcessor` cannot be built without torchvision: the copy is saved with its image-only
    subclass, then `model_index.json` and the processor's config are made to name
    `Qwen2VLProcessor`, as a published directory does (`rollout.models.qwenimage_edit`).
    """
    from transformers import Qwen2VLImageProcessor

    from rollout.models.qwenimage_edit import ImageOnlyQwen2VLProcessor

    tokenizer = tiny_qwen2_tokenizer(edit=True)
    patch = 28  # the vision tower's 14 px patches, merged 2x2
    image_processor = Qwen2VLImageProcessor(size={"shortest_edge": 4 * patch**2, "longest_edge": 16 * patch**2})
    processor = ImageOnlyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer)
    # The condition is always about 1 MP: a VAE of 2 channels at full resolution encodes it in a
    # fraction of a second on a CPU.
    pipe = pipeline_class(**_qwenimage_components(tokenizer, transformer_heads, vae_width=2), processor=processor)
    _check_system_prefix(pipe, tokenizer)
    pipe.save_pretrained(path)
    for file, entry, value in (
        (path / "model_index.json", "processor", ["transformers", "Qwen2VLProcessor"]),
        (path / "processor" / "processor_config.json", "processor_class", "Qwen2VLProcessor"),
    ):
        config = json.loads(file.read_text())
        config[entry] = value
        file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


def build_tiny_qwenimage_edit_plus(path: Path, transformer_heads: int = 2) -> Path:
    """Save a tiny Qwen-Image-Edit-2509-like `QwenImageEditPlusPipeline` to `path`: `build_tiny_qwenimage_edit`'s."""
    return build_tiny_qwenimage_edit(path, transformer_heads, pipeline_class=QwenImageEditPlusPipeline)


def _wan_transformer(
    text_dim: int, channels: int, heads: int, in_channels: int | None = None, image_dim: int | None = None
) -> WanTransformer3DModel:
    """Wan's DiT layout (patch (1, 2, 2), RMS qk-norm across heads, cross-attention norm) with two
    tiny layers; head dim 16 splits into 8 temporal and 4 + 4 spatial rotary frequencies.

    `in_channels`: the input's channels where they are not the output's (image-to-video: the latents,
    the mask and the condition); `image_dim`: the width of CLIP image embeddings it takes, with its
    own key and value projections for them, as Wan2.1-I2V (`added_kv_proj_dim` its width)."""
    torch.manual_seed(_SEED)
    image = {} if image_dim is None else {"image_dim": image_dim, "added_kv_proj_dim": 16 * heads}
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=16,
        in_channels=in_channels or channels,
        out_channels=channels,
        **image,
        text_dim=text_dim,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    )


def _wan_scheduler(flow_shift: float) -> UniPCMultistepScheduler:
    # As diffusers' conversion script writes every Wan checkpoint's scheduler.
    return UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=flow_shift
    )


def _wan21_vae() -> AutoencoderKLWan:
    """Wan2.1's VAE layout (16 channels, 4x temporal and 8x spatial compression, causal 3D convs)
    with tiny widths."""
    torch.manual_seed(_SEED)
    return AutoencoderKLWan(
        base_dim=8,
        z_dim=_LATENT_CHANNELS,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=_QWEN_LATENTS_MEAN,
        latents_std=_QWEN_LATENTS_STD,
    )


def _save_wan(
    path: Path,
    vae: AutoencoderKLWan,
    flow_shift: float,
    transformer_heads: int,
    two_experts: bool = False,
    pipeline_class: type = WanPipeline,
    in_channels: int | None = None,
    image_dim: int | None = None,
    **config,
) -> Path:
    """A tiny `WanPipeline` (or `pipeline_class` with its own `config` components) on `vae` (UMT5 of
    width 32, the published UniPC scheduler at `flow_shift`), with a second, differently drawn
    transformer as `transformer_2` if `two_experts`, saved to `path`; `in_channels` and `image_dim`
    as `_wan_transformer` takes them."""
    tokenizer = tiny_t5_tokenizer()
    text_encoder = _t5_encoder(tokenizer, d_model=32, umt5=True)
    transformer = _wan_transformer(
        text_encoder.config.d_model, vae.config.z_dim, transformer_heads, in_channels=in_channels, image_dim=image_dim
    )
    denoisers = {"transformer": transformer}
    if two_experts:
        torch.manual_seed(_SEED + 1)
        denoisers["transformer_2"] = WanTransformer3DModel.from_config(denoisers["transformer"].config)
    pipe = pipeline_class(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=_wan_scheduler(flow_shift=flow_shift),
        **denoisers,
        **config,
    )
    pipe.save_pretrained(path)
    return path


def build_tiny_wan21(path: Path, transformer_heads: int = 2) -> Path:
    """Save a tiny Wan2.1-T2V-like `WanPipeline` to `path` and return `path`.

    A UMT5 text encoder of width 32 with the T5-style tokenizer, one `WanTransformer3DModel`
    (16 latent channels), Wan2.1's `AutoencoderKLWan` layout and statistics, and the published
    scheduler: UniPC multistep on flow sigmas, `flow_shift` 3.0.
    """
    return _save_wan(path, _wan21_vae(), flow_shift=3.0, transformer_heads=transformer_heads)


def build_tiny_wan22_a14b(path: Path, transformer_heads: int = 2) -> Path:
    """Save a tiny Wan2.2-T2V-A14B-like `WanPipeline`: two experts, `transformer` for the high-noise
    steps and `transformer_2` (other weights) for the rest, switching at `boundary_ratio` 0.875, on
    Wan2.1's VAE; scheduler `flow_shift` 3.0."""
    return _save_wan(
        path, _wan21_vae(), flow_shift=3.0, transformer_heads=transformer_heads, two_experts=True, boundary_ratio=0.875
    )


def _wan_i2v_channels() -> int:
    """An image-to-video transformer's input: the latents, the 4-channel mask (the VAE's temporal
    factor) and the condition's latents."""
    return 2 * _LATENT_CHANNELS + 4


def build_tiny_wan21_i2v(path: Path, transformer_heads: int = 2) -> Path:
    """Save a tiny Wan2.1-I2V-like `WanImageToVideoPipeline` to `path` and return `path`.

    The components of `build_tiny_wan21` with a transformer on 36 input channels (latents, mask,
    condition) that takes CLIP image embeddings of width 24 with its own key and value
    projections, a `CLIPVisionModel` (width 24, patch 8 on 32 px: 17 tokens) and CLIP's image
    processor resizing and cropping to 32 px; scheduler `flow_shift` 3.0 (the 480P checkpoint's).
    """
    vision_width = 24
    torch.manual_seed(_SEED)
    image_encoder = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=vision_width,
            intermediate_size=2 * vision_width,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        )
    )
    image_processor = CLIPImageProcessor(
        **{**_CLIP_L14_IMAGE_PROCESSOR, "size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}}
    )
    return _save_wan(
        path,
        _wan21_vae(),
        flow_shift=3.0,
        transformer_heads=transformer_heads,
        pipeline_class=WanImageToVideoPipeline,
        in_channels=_wan_i2v_channels(),
        image_dim=vision_width,
        image_encoder=image_encoder,
        image_processor=image_processor,
    )


def build_tiny_wan22_i2v_a14b(path: Path, transformer_heads: int = 2) -> Path:
    """Save a tiny Wan2.2-I2V-A14B-like `WanImageToVideoPipeline`: two experts on 36 input channels
    switching at `boundary_ratio` 0.9, no CLIP image encoder, Wan2.1's VAE; scheduler `flow_shift` 5.0."""
    return _save_wan(
        path,
        _wan21_vae(),
        flow_shift=5.0,
        transformer_heads=transformer_heads,
        two_experts=True,
        pipeline_class=WanImageToVideoPipeline,
        in_channels=_wan_i2v_channels(),
        boundary_ratio=0.9,
    )


def build_tiny_wan22_ti2v(path: Path, transformer_heads: int = 2) -> Path:
    """Save a tiny Wan2.2-TI2V-5B-like `WanPipeline`: one transformer on 48 latent channels with a
    time input per token (`expand_timesteps`), and the Wan2.2 VAE layout (residual blocks, 2x2
    patchified pixels, 16x spatial compression, its 48 channel statistics); scheduler `flow_shift` 5.0."""
    torch.manual_seed(_SEED)
    vae = AutoencoderKLWan(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=len(_WAN22_LATENTS_MEAN),
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=_WAN22_LATENTS_MEAN,
        latents_std=_WAN22_LATENTS_STD,
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_temporal=4,
        scale_factor_spatial=16,
    )
    return _save_wan(path, vae, flow_shift=5.0, transformer_heads=transformer_heads, expand_timesteps=True)


# LTX-Video's published scheduler: dynamic shift over the video's latent tokens, stretched to 0.1.
_LTX_SCHEDULER = {
    "use_dynamic_shifting": True,
    "base_shift": 0.95,
    "max_shift": 2.05,
    "base_image_seq_len": 1024,
    "max_image_seq_len": 4096,
    "shift_terminal": 0.1,
    "shift": 1.0,
}


def build_tiny_ltx(path: Path, transformer_heads: int = 2) -> Path:
    """Save a tiny LTX-Video-like `LTXPipeline` to `path` and return `path`.

    A T5 encoder of width 32, an `LTXVideoTransformer3DModel` with one layer on LTX's 128 latent
    channels (patch 1, RMS qk-norm across heads), an `AutoencoderKLLTXVideo` with LTX's layout
    (4x4 pixel patches and three spatio-temporal downsamplings: 32x in space, 8x in time) at tiny
    widths, and LTX-Video's scheduler.
    """
    tokenizer = tiny_t5_tokenizer()
    text_encoder = _t5_encoder(tokenizer, d_model=32)
    torch.manual_seed(_SEED)
    transformer = LTXVideoTransformer3DModel(
        in_channels=128,
        out_channels=128,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=transformer_heads,
        attention_head_dim=16,
        cross_attention_dim=16 * transformer_heads,
        num_layers=1,
        caption_channels=text_encoder.config.d_model,
    )
    torch.manual_seed(_SEED)
    vae = AutoencoderKLLTXVideo(
        latent_channels=128,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
    )
    pipe = LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**_LTX_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(path)
    return path


# openai/clip-vit-large-patch14's published preprocessor_config.json (written there in the older
# form `size: 224, crop_size: 224`): resize the shortest edge (bicubic), centre-crop a square,
# rescale to [0, 1], normalise with CLIP's mean and std.
_CLIP_L14_IMAGE_PROCESSOR = {
    "do_resize": True,
    "size": {"shortest_edge": 224},
    "resample": 3,  # bicubic
    "do_center_crop": True,
    "crop_size": {"height": 224, "width": 224},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_convert_rgb": True,
}


def build_tiny_clip(path: Path, image_size: int = 32) -> Path:
    """Save a tiny CLIP-like `CLIPModel` with its `CLIPProcessor` to `path` and return `path`: what
    the CLIP scorers (`rollout.scorers.clip`) load.

    Text and vision towers of width 32 with two layers (vision patch 8 on `image_size` px), a
    projection of 16, the CLIP-style tokenizer, and openai/clip-vit-large-patch14's image processor
    resizing and cropping to `image_size` instead of 224.
    """
    tokenizer = tiny_clip_tokenizer()
    tower = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    text_config = CLIPTextConfig(
        **tower,
        vocab_size=len(tokenizer),
        max_position_embeddings=tokenizer.model_max_length,
        # The pooled output is read at the first end-of-text token, found by this id.
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision_config = CLIPVisionConfig(**tower, image_size=image_size, patch_size=8)
    torch.manual_seed(_SEED)
    model = CLIPModel(CLIPConfig(text_config=text_config, vision_config=vision_config, projection_dim=16))
    image_processor = CLIPImageProcessor(
        **{
            **_CLIP_L14_IMAGE_PROCESSOR,
            "size": {"shortest_edge": image_size},
            "crop_size": {"height": image_size, "width": image_size},
        }
    )
    model.save_pretrained(path)
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(path)
    return path
