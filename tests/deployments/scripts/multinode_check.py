"""Run by `test_multinode.py` in a process of its own: a simulated two-node Ray cluster on this
machine (`ray.cluster_utils.Cluster`), one worker replica on each node.

Checks that a weight update reaches the replicas on both nodes through the object store, and
that a request fanned out over them returns one schedule. Prints one JSON line of findings.
"""

import json
import sys

import ray
import torch
from ray import serve
from ray.cluster_utils import Cluster

from deployments.app import build_app
from deployments.weights import ObjectStoreTensors
from rollout.models.registry import load_pipeline
from rollout.weights import weights_checksum


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        port = int(sys.argv[1])
        # One proxy: the simulated nodes share this machine's ports, so a proxy per node collides.
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        # No scorers: the request asks for no rewards, and the embedded model's default scorers
        # would be two more replica processes to start on the two 1-CPU nodes, never called.
        config = {"num_worker_replicas": 2, "worker_max_replicas_per_node": 1, "worker_torch_threads": 1, "scorers": {}}
        handle = serve.run(build_app(config), name="multinode", route_prefix="/")

        pipeline = load_pipeline()
        new_weights = {name: t + 0.01 for name, t in pipeline.transformer.state_dict().items()}
        pipeline.transformer.load_state_dict(new_weights)
        update = handle.update_weights_from_tensor.remote(
            ObjectStoreTensors(ray.put(new_weights)), weight_version="multinode-1"
        ).result()
        checksums = handle.get_weights_checksum.remote(["transformer"]).result()

        result = handle.generate.remote({"prompt": ["1", "2"], "num_outputs_per_prompt": 4, "num_inference_steps": 3})
        result = result.result()
        parts = result.fetch().parts
        batch = result.batch()
        print(
            json.dumps(
                {
                    "nodes": len(ray.nodes()),
                    "update_success": update.success,
                    "replica_checksums_match": {c["transformer"] for c in checksums.values()}
                    == {weights_checksum(pipeline.transformer)},
                    "replicas_checked": len(checksums),
                    "part_nodes": sorted(part.node_id for part in parts),
                    "part_replicas": sorted(part.replica for part in parts),
                    "sample_versions": sorted({s.weight_version for s in batch.samples}),
                    "one_schedule": all(s.schedule is batch.schedule for s in batch.samples),
                    "num_samples": len(batch.samples),
                    "sigmas_shape": list(batch.schedule.sigmas.shape),
                    "finite": bool(torch.isfinite(torch.stack([s.log_probs for s in batch.samples])).all()),
                }
            ),
            flush=True,
        )
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
