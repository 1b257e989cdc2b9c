"""Where a rollout's time goes against the pipeline's: each model's time per call, by forward hooks.

For one tiny family (widened as in `benchmarks.throughput`), the rollout and the pipeline that
decodes too take turns; each round prints, for each, its wall time, the time inside the
transformer, the text encoders and the VAE's decoder (with their call counts), and the rest: the
loop's own work around the models.

    .venv/bin/python -m benchmarks.module_times qwenimage --micro-batch-size 16 --decode-batch-size 8
    .venv/bin/python -m benchmarks.module_times sd3 --micro-batch-size 16 --decode-batch-size 8 --cfg
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.throughput import STEPS, build_families, runs
from rollout.micro_batching import MicroBatching
from rollout.models.registry import load_pipeline

TIMED_MODULES = ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3")


class ModuleTimes:
    """Seconds spent in, and calls of, each hooked module since the last `reset`."""

    def __init__(self, modules: dict[str, torch.nn.Module]):
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()
        for name, module in modules.items():
            started = {}
            module.register_forward_pre_hook(lambda m, args, s=started: s.update(at=time.perf_counter()))
            module.register_forward_hook(lambda m, args, out, n=name, s=started: self._add(n, s["at"]))

    def _add(self, name: str, started: float) -> None:
        self.seconds[name] += time.perf_counter() - started
        self.calls[name] += 1

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("family", choices=list(STEPS))
    parser.add_argument("--micro-batch-size", type=int, default=4, help="the transformer's rows per call")
    parser.add_argument("--decode-batch-size", type=int, help="images per VAE call; default: the transformer's")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--cfg", action="store_true", help="with classifier-free guidance")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as root:
        path = build_families(Path(root), [args.family])[args.family]
        micro_batching = MicroBatching(args.micro_batch_size, decode_default=args.decode_batch_size)
        family = load_pipeline(None, path, micro_batching=micro_batching)
        calls = runs(family, args.family, args.batch_size, args.cfg, ("pt",))
        modules = {name: getattr(family.pipe, name, None) for name in TIMED_MODULES}
        times = ModuleTimes({**{n: m for n, m in modules.items() if m is not None}, "vae.decoder": family.vae.decoder})
        for run in calls.values():  # warm-up
            run()
        print(f"{args.family} B={args.batch_size}{' CFG' if args.cfg else ''}, {args.threads} torch threads; ms (calls)")
        for _ in range(args.rounds):
            for name, run in calls.items():
                times.reset()
                started = time.perf_counter()
                run()
                total = time.perf_counter() - started
                parts = "  ".join(f"{n} {s * 1e3:.1f} ({times.calls[n]})" for n, s in sorted(times.seconds.items()))
                rest = total - sum(times.seconds.values())
                print(f"{name:12s} total {total * 1e3:8.1f}  {parts}  rest {rest * 1e3:.1f}", flush=True)


if __name__ == "__main__":
    main()
