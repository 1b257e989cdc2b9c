"""What Qwen-Image's text buckets cost when prompts of different lengths share a sampler call.

Four prompts, each in a group of `--group-size` samples, sampled in one call (the widened tiny copy
of `benchmarks.throughput`, 128 px, ODE, 10 steps). Rows of different text buckets cannot share a
transformer call, so finer buckets mean cheaper rows but more, emptier calls. Prints each prompt's
token count and padded length, the transformer rows computed and the rollout's median time.

    .venv/bin/python -m benchmarks.text_buckets --prompts short
    .venv/bin/python -m benchmarks.text_buckets --prompts mixed
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchmarks.serving import Spread
from benchmarks.throughput import SIZE, STEPS, build_families
from rollout.micro_batching import MicroBatching
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.sampler import sample_call
from rollout.transitions import TransitionKind

PROMPT_SETS = {
    # 7, 16, 22 and 27 tokens with the tiny tokenizer: one 32-token bucket
    "short": ["a cat", "a red fox in snow", "a small boat on a lake", "a lighthouse on a cliff at dusk"],
    # 7, 16, 36 and 68 tokens
    "mixed": [
        "a cat",
        "a red fox in snow",
        "a lighthouse on a cliff at night in a storm",
        "an old sailing ship with torn sails drifting near a rocky coast under grey skies",
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--prompts", choices=list(PROMPT_SETS), default="short")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    prompts = PROMPT_SETS[args.prompts]
    batch = [prompt for prompt in prompts for _ in range(args.group_size)]
    options = SamplingOptions(
        num_inference_steps=STEPS["qwenimage"], height=SIZE, width=SIZE, sde_type=TransitionKind.ODE
    )
    with tempfile.TemporaryDirectory() as root:
        path = build_families(Path(root), ["qwenimage"])["qwenimage"]
        family = load_pipeline(None, path, micro_batching=MicroBatching(args.micro_batch_size))
        masks = [family.encode_prompt(prompt, options)["encoder_hidden_states_mask"][0] for prompt in prompts]
        seconds = []
        for _ in range(args.rounds + 1):  # the first is a warm-up
            started = time.perf_counter()
            call = sample_call(family, batch, list(range(len(batch))), options)
            seconds.append(time.perf_counter() - started)
        timed = seconds[1:]
    print(f"(tokens, padded to): {[(int(mask.sum()), len(mask)) for mask in masks]}")
    print(
        f"{len(prompts)} prompts x {args.group_size} samples, calls of {args.micro_batch_size}: "
        f"{call.transformer_rows} transformer rows, rollout {Spread(tuple(t * 1e3 for t in timed)):.0f} ms, "
        f"median (min - max) of {args.rounds}"
    )


if __name__ == "__main__":
    main()
