"""The published models at their published sizes with random weights: what `scripts/gpu_check.py`
times on the device machine, where no real weights exist and nothing can be downloaded. Each takes
the tiny copy's pipeline (`rollout.testing.builders`) for its tokenizers and scheduler (a
tokenizer's vocabulary does not change the compute); each record of `rollout.testing.families`
with a `gpu_check` names its function here.

Parameters are created in the default dtype on the default device: the script sets both (bf16, the
GPU), as a 12B model built in fp32 on the CPU first would take minutes. diffusers and transformers
are imported by the functions, as where they run.
"""


def _clip_l(with_projection: bool):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        projection_dim=768, vocab_size=49408, max_position_embeddings=77, hidden_act="quick_gelu",
    )  # fmt: skip
    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)


def _clip_g():
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
        projection_dim=1280, vocab_size=49408, max_position_embeddings=77, hidden_act="gelu",
    )  # fmt: skip
    return CLIPTextModelWithProjection(config)


def _t5_xxl():
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, vocab_size=32128,
        feed_forward_proj="gated-gelu",
    )  # fmt: skip
    return T5EncoderModel(config)


def _vae(scaling_factor: float, shift_factor: float):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=2, sample_size=1024, scaling_factor=scaling_factor, shift_factor=shift_factor,
        use_quant_conv=False, use_post_quant_conv=False,
    )  # fmt: skip


def sd35_medium(tiny_pipe):
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    transformer = SD3Transformer2DModel(
        sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
        attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
        caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
        dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
    )  # fmt: skip
    return StableDiffusion3Pipeline(
        transformer=transformer, vae=_vae(1.5305, 0.0609), scheduler=tiny_pipe.scheduler,
        text_encoder=_clip_l(with_projection=True), tokenizer=tiny_pipe.tokenizer,
        text_encoder_2=_clip_g(), tokenizer_2=tiny_pipe.tokenizer_2,
        text_encoder_3=_t5_xxl(), tokenizer_3=tiny_pipe.tokenizer_3,
    )  # fmt: skip


def flux1_dev(tiny_pipe, pipeline_class: type | None = None):
    from diffusers import FluxPipeline, FluxTransformer2DModel

    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
        guidance_embeds=True, axes_dims_rope=(16, 56, 56),
    )  # fmt: skip
    return (pipeline_class or FluxPipeline)(
        transformer=transformer, vae=_vae(0.3611, 0.1159), scheduler=tiny_pipe.scheduler,
        text_encoder=_clip_l(with_projection=False), tokenizer=tiny_pipe.tokenizer,
        text_encoder_2=_t5_xxl(), tokenizer_2=tiny_pipe.tokenizer_2,
    )  # fmt: skip


def flux1_kontext_dev(tiny_pipe):
    """FLUX.1-Kontext-dev: FLUX.1-dev's published configuration, in its editing pipeline."""
    from diffusers import FluxKontextPipeline

    return flux1_dev(tiny_pipe, FluxKontextPipeline)


def wan21_t2v_1_3b(tiny_pipe):
    """Wan2.1-T2V-1.3B's published configuration: its DiT, UMT5-XXL and the Wan2.1 VAE."""
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
        text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
    )  # fmt: skip
    text_encoder = UMT5EncoderModel(
        UMT5Config(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, vocab_size=256384,
                   feed_forward_proj="gated-gelu", relative_attention_num_buckets=32)
    )  # fmt: skip
    return WanPipeline(
        tokenizer=tiny_pipe.tokenizer, text_encoder=text_encoder, vae=AutoencoderKLWan(),
        scheduler=tiny_pipe.scheduler, transformer=transformer,
    )  # fmt: skip


def _qwen25_vl_7b():
    """Qwen2.5-VL-7B-Instruct's published configuration: Qwen-Image's (and Qwen-Image-Edit's) text encoder."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
            "num_key_value_heads": 4, "vocab_size": 152064, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        },
        vision_config={
            "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 3584,
            "fullatt_block_indexes": [7, 15, 23, 31], "window_size": 112,
        },
    )  # fmt: skip
    return Qwen2_5_VLForConditionalGeneration(config)


def qwen_image_edit(tiny_pipe):
    """Qwen-Image-Edit: the 20B MMDiT (diffusers' defaults are its published configuration), the
    Qwen-Image VAE and Qwen2.5-VL-7B, with Qwen2-VL's published image processing on the tiny copy's
    tokenizer (the processor without a video part: `rollout.models.qwenimage_edit`)."""
    from diffusers import AutoencoderKLQwenImage, QwenImageEditPipeline, QwenImageTransformer2DModel
    from transformers import Qwen2VLImageProcessor

    from rollout.models.qwenimage_edit import ImageOnlyQwen2VLProcessor

    processor = ImageOnlyQwen2VLProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=tiny_pipe.processor.tokenizer)
    return QwenImageEditPipeline(
        transformer=QwenImageTransformer2DModel(), vae=AutoencoderKLQwenImage(), scheduler=tiny_pipe.scheduler,
        text_encoder=_qwen25_vl_7b(), tokenizer=tiny_pipe.tokenizer, processor=processor,
    )  # fmt: skip
