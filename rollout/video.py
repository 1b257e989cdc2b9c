"""Videos people look at: a sample's frames as an H.264 MP4, written with PyAV (FFmpeg).

A video model's `generated_output` (and `SampleTrajectory.image`) is `[3, F, H, W]` in [0, 1],
SGLang's layout. Frames are rounded to 8 bits as they are written; `frames_as_uint8` is that
rounding, the one SGLang's `rollout_video_dtype: "uint8"` names. PyAV is the optional `video`
extra (`pip install diffusion-rollout[video]`), imported only when a video is written.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rollout.errors import InvalidRequestError


def frames_as_uint8(frames: torch.Tensor) -> torch.Tensor:
    """`[3, F, H, W]` in [0, 1] as uint8 of the same layout, each value rounded to the nearest of 0..255."""
    if frames.ndim != 4 or frames.shape[0] != 3:
        raise ValueError(f"expected frames of shape [3, F, H, W], got {tuple(frames.shape)}")
    return (frames.float().clamp(0, 1) * 255).round().to(torch.uint8)


def write_mp4(frames: torch.Tensor, path: str | Path, fps: int) -> Path:
    """Writes `[3, F, H, W]` frames in [0, 1] to `path` as H.264 (yuv420p, so even sizes) at `fps`."""
    import av  # the optional `video` extra

    if isinstance(fps, bool) or not isinstance(fps, int) or fps < 1:
        raise InvalidRequestError("fps", f"must be a positive integer, got {fps!r}")
    pixels = frames_as_uint8(frames).permute(1, 2, 3, 0).contiguous()  # [F, H, W, 3], as FFmpeg's rgb24
    _, height, width, _ = pixels.shape
    if height % 2 or width % 2:
        raise ValueError(f"H.264 in yuv420p needs an even height and width, got {height}x{width}")
    path = Path(path)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for frame in pixels.numpy():
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())  # flushes the encoder's delayed frames
    return path
