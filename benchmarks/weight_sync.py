"""Time to push new weights to every worker replica through the object store.

    python -m benchmarks.weight_sync --output docs/weight_sync.md

For each size (about 10 MB, 100 MB and 1 GB of fp32 transformer weights), serves a model of the
embedded architecture scaled to that size (random weights, saved to a temporary directory) on
2 worker replicas, then, `--repeats` times:
- puts a state dict of random tensors with the transformer's names and shapes (`ray.put`, once);
- times `handle.update_weights_from_tensor(ObjectStoreTensors(ref))`, which returns when both
  replicas serve the new weights (each fetches the tensors, checks them, keeps an undo copy and
  writes them into its model);
- times one `ray.get` of the same object in another process on this node (an actor, warm):
  what a single replica's fetch costs.
after one warm-up round that is not counted.
The ratio update / get says what the broadcast, the checks and the copies add to one fetch.
Prints one JSON line per size and writes a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
from ray import serve

from deployments.app import build_app
from deployments.weights import ObjectStoreTensors
from rollout.models.digits import IMAGE_SIZE, DigitFlowPipeline, DigitPromptEncoder

NOTES = """
Reading the table:
- An update returns when both replicas serve the new weights. Each replica fetches the tensors
  from the object store (deserialising a copy), checks names, shapes and dtypes, keeps a copy of
  the weights it replaces (to undo the update if another replica refuses it) and writes the new
  ones; the two replicas do this at the same time, on this machine's 2 cores. Small updates
  are dominated by the fixed cost of the round (about 40 ms: the command, both replicas'
  reports, the commit).
- One ray.get is one warm process fetching the same object, just before the update, so it is
  the object's first reader; the replicas read it after. Fetch times of large objects vary
  several-fold from run to run here, which is why both columns list every run.
"""

# (layers, attention heads of 64) of the embedded architecture, for about 10 MB, 100 MB, 1 GB.
SIZES = {"10 MB": (1, 5), "100 MB": (3, 8), "1 GB": (7, 16)}


def scaled_pipeline(layers: int, heads: int) -> DigitFlowPipeline:
    encoder = DigitPromptEncoder()
    transformer = SD3Transformer2DModel(
        sample_size=IMAGE_SIZE,
        patch_size=2,
        in_channels=1,
        out_channels=1,
        num_layers=layers,
        attention_head_dim=64,
        num_attention_heads=heads,
        joint_attention_dim=encoder.token_dim,
        caption_projection_dim=64 * heads,
        pooled_projection_dim=encoder.pooled.embedding_dim,
        pos_embed_max_size=IMAGE_SIZE // 2,
    )
    return DigitFlowPipeline(transformer, encoder, FlowMatchEulerDiscreteScheduler())


@ray.remote(num_cpus=0)
class Fetcher:
    """A process of its own on this node, started once, that fetches an object like a replica does."""

    def timed_get(self, refs: list) -> float:
        start = time.perf_counter()
        ray.get(refs[0])
        return time.perf_counter() - start


def measure(name: str, layers: int, heads: int, repeats: int, directory: Path, fetcher) -> dict:
    pipeline = scaled_pipeline(layers, heads)
    pipeline.save_pretrained(directory / name, weights_dtype=torch.float32)
    shapes = {key: t.shape for key, t in pipeline.transformer.state_dict().items()}
    num_bytes = sum(t.numel() * t.element_size() for t in pipeline.transformer.state_dict().values())
    del pipeline
    app = f"weight-sync-{layers}x{heads}"
    config = {"app_name": app, "num_worker_replicas": 2, "worker_torch_threads": 1}
    config["model"] = {"path": str(directory / name)}
    handle = serve.run(build_app(config), name=app, route_prefix=f"/{app}")
    update_s, get_s, put_s = [], [], []
    for repeat in range(-1, repeats):  # -1: a warm-up, not counted
        state_dict = {key: torch.randn(shape) for key, shape in shapes.items()}
        start = time.perf_counter()
        ref = ray.put(state_dict)
        put_s.append(time.perf_counter() - start)
        del state_dict
        get_s.append(ray.get(fetcher.timed_get.remote([ref])))
        start = time.perf_counter()
        result = handle.update_weights_from_tensor.remote(ObjectStoreTensors(ref), weight_version=f"{repeat}").result()
        update_s.append(time.perf_counter() - start)
        assert result.success, result.message
        del ref
        if repeat < 0:
            update_s, get_s, put_s = [], [], []
    served = handle.info.remote().result()["replica_weight_versions"]
    assert len(served) == 2 and set(served.values()) == {str(repeats - 1)}, served
    serve.delete(app)
    update, get = statistics.median(update_s), statistics.median(get_s)
    return {
        "size": name,
        "mib": round(num_bytes / 2**20, 1),
        "tensors": len(shapes),
        "put_s": round(statistics.median(put_s), 3),
        "update_s": round(update, 3),
        "get_s": round(get, 3),
        "update_vs_get": round(update / get, 2),
        "update_runs_s": [round(t, 3) for t in update_s],
        "get_runs_s": [round(t, 3) for t in get_s],
    }


def markdown(results: list[dict], repeats: int) -> str:
    lines = [
        "# Weight sync",
        "",
        "Command: `python -m benchmarks.weight_sync --output docs/weight_sync.md`  ",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} cores, "
        f"torch {torch.__version__}, ray {ray.__version__}.  ",
        f"2 worker replicas on this node; median of {repeats} updates of random fp32 tensors shaped like the "
        "scaled transformer's.",
        "",
        "| size | tensors | ray.put (s) | update, both replicas (s) | one ray.get (s) | update / get "
        "| updates (s) | gets (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        updates, gets = (", ".join(map(str, r[key])) for key in ("update_runs_s", "get_runs_s"))
        lines.append(
            f"| {r['mib']} MiB | {r['tensors']} | {r['put_s']} | {r['update_s']} | {r['get_s']} | "
            f"{r['update_vs_get']}x | {updates} | {gets} |"
        )
    return "\n".join(lines) + "\n" + NOTES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=None, help="markdown file for the results table")
    args = parser.parse_args()

    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8126})
    fetcher = Fetcher.remote()
    ray.get(fetcher.timed_get.remote([ray.put(torch.zeros(1))]))  # started, torch imported
    results = []
    with tempfile.TemporaryDirectory() as directory:
        for name in args.sizes:
            results.append(measure(name, *SIZES[name], args.repeats, Path(directory), fetcher))
            print(json.dumps(results[-1]), flush=True)
    serve.shutdown()
    ray.shutdown()
    if args.output:
        args.output.write_text(markdown(results, args.repeats))


if __name__ == "__main__":
    main()
