"""Which call sizes padding can keep a sample's bits at: `check_batch_invariance` under padding.

For each tiny image family (`rollout.testing.families`) and call size, a call of that many rows against
the same rows each moved one position on, in the transformer (T) and the VAE (V): a letter marks a
model that gave a row other bits at another position in the call. This is what each worker of an
image family checks at start, and what `calibrate` passes over.

    .venv/bin/python -m benchmarks.call_positions --threads 2 --size 32
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from rollout.calibration import UNGUIDED, check_batch_invariance
from rollout.micro_batching import MicroBatching
from rollout.models.registry import load_pipeline
from rollout.testing.families import IMAGE_FAMILIES, TINY_FAMILIES

SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--size", type=int, default=32, help="image height and width, px")
    parser.add_argument("--transformer-heads", type=int, help="widen the tiny copies (8: width 128)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    widened = {} if args.transformer_heads is None else {"transformer_heads": args.transformer_heads}
    print(f"{args.threads} torch threads, {args.size} px; T: transformer, V: VAE")
    print("| family | " + " | ".join(map(str, SIZES)) + " |")
    print("|---" * (len(SIZES) + 1) + "|")
    with tempfile.TemporaryDirectory() as root:
        for name in IMAGE_FAMILIES:
            pipeline = load_pipeline(None, TINY_FAMILIES[name].build(Path(root) / name, **widened))
            marks = []
            for rows in SIZES:
                pipeline.micro_batching = MicroBatching(rows)
                # Without guidance, so that a call has these rows in every family.
                check = check_batch_invariance(pipeline, args.size, args.size, UNGUIDED)
                marks.append(", ".join(m for m, d in (("T", check.velocity_difference), ("V", check.image_difference)) if d))
            print(f"| {name} | " + " | ".join(marks) + " |", flush=True)


if __name__ == "__main__":
    main()
