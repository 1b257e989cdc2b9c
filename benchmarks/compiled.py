"""Whether `torch.compile` keeps a rollout exact, on this CPU (inductor): a tiny family's velocity,
eager and compiled, without gradients (the rollout's forward) and under autograd with the
transformer's weights trainable (the trainer's replay forward, `rollout.replay`), on the same
inputs, compared bit for bit; and the time of each.

    .venv/bin/python -m benchmarks.compiled                     # the tiny SD3 and FLUX.1 copies
    .venv/bin/python -m benchmarks.compiled --families qwenimage --batch 4

A compiled path can be offered as exact only if its forward without gradients and its forward
under autograd give the same bits (then a replay compiled the same way reproduces the rollout):
the `compiled: no grad = grad` column. `compiled = eager` says whether compiling changes the bits
at all (a server and a trainer would both have to compile). Speed is measured here, never asserted.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.sampler import resolve_options
from rollout.testing.families import TINY_FAMILIES

PROMPT = "a photo of a corgi"


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.int32)


def velocities(family: str, batch: int, size: int, repeats: int, device: str) -> dict:
    with tempfile.TemporaryDirectory() as root:
        record = TINY_FAMILIES[family]
        pipeline = load_pipeline(record.family.name, record.build(Path(root) / family), device=device)
    options = resolve_options(pipeline, SamplingOptions(height=size, width=size, **(TINY_FAMILIES[family].guided or {})))
    conditioning = pipeline.encode_prompts([PROMPT] * batch, [""] * batch, options).buckets[0].conditioning
    generator = torch.Generator().manual_seed(0)
    x_t = torch.randn((batch, *pipeline.latent_shape(options.height, options.width, options.num_frames)), generator=generator)
    x_t, timestep = x_t.to(device), torch.full((batch,), 500.0, device=device)
    eager = pipeline.pipe.transformer  # what `run_transformer` calls

    def forward(grad: bool) -> torch.Tensor:
        eager.requires_grad_(grad)  # a full fine-tune's replay: every weight trainable
        with torch.set_grad_enabled(grad):
            velocity = pipeline.predict_velocity(x_t, timestep, conditioning, options).detach()
        if device == "cuda":
            torch.cuda.synchronize()
        return velocity

    def timed(grad: bool) -> tuple[torch.Tensor, float, float]:
        start = time.perf_counter()
        first = forward(grad)  # compiles, for a compiled transformer
        first_s = time.perf_counter() - start
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            again = forward(grad)
            seconds.append(time.perf_counter() - start)
            assert torch.equal(bits(again), bits(first)), "a path gave other bits on a second call"
        return first, first_s, statistics.median(seconds)

    found = {"family": family, "batch": batch, "size": size}
    outputs = {}
    for mode in ("eager", "compiled"):
        pipeline.pipe.transformer = eager if mode == "eager" else torch.compile(eager)
        for grad in (False, True):
            key = f"{mode}_{'grad' if grad else 'no_grad'}"
            outputs[key], found[f"{key}_first_s"], found[f"{key}_s"] = timed(grad)
    torch._dynamo.reset()
    def same(a: str, b: str) -> bool:
        return bool(torch.equal(bits(outputs[a]), bits(outputs[b])))

    found["eager_no_grad_equals_grad"] = same("eager_no_grad", "eager_grad")
    found["compiled_no_grad_equals_grad"] = same("compiled_no_grad", "compiled_grad")
    found["compiled_equals_eager"] = same("compiled_no_grad", "eager_no_grad")
    found["compiled_max_abs_difference"] = (outputs["compiled_no_grad"] - outputs["eager_no_grad"]).abs().max().item()
    return found


def table(results: list[dict], repeats: int) -> str:
    lines = [
        "Command: `python -m benchmarks.compiled`  ",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
        f"median of {repeats} calls after the first (which compiles).",
        "",
        "| family | batch x size | eager: no grad = grad | compiled: no grad = grad | compiled = eager (max abs diff) | "
        "eager no grad (s) | compiled no grad (s) | eager grad (s) | compiled grad (s) | compiling (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['family']} | {r['batch']} x {r['size']} px | {r['eager_no_grad_equals_grad']} | "
            f"{r['compiled_no_grad_equals_grad']} | {r['compiled_equals_eager']} ({r['compiled_max_abs_difference']:.2e}) | "
            f"{r['eager_no_grad_s']:.3f} | {r['compiled_no_grad_s']:.3f} | {r['eager_grad_s']:.3f} | "
            f"{r['compiled_grad_s']:.3f} | {r['compiled_no_grad_first_s'] + r['compiled_grad_first_s']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["sd3", "flux"], choices=[n for n in TINY_FAMILIES if n != "embedded-digits"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    results = [velocities(family, args.batch, args.size, args.repeats, args.device) for family in args.families]
    print(table(results, args.repeats))


if __name__ == "__main__":
    main()
