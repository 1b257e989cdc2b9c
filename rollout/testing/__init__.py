"""What the tests, the benchmarks and the GPU check build the model families from, kept apart from
the runtime library as `torch.testing` is (nothing under `rollout/` but this package imports it):

- `families`: one record per tiny copy of a family, with the settings every parametrised test,
  benchmark and `scripts/gpu_check.py` read; adding a family is its model file in
  `rollout/models/` and one record there (with its builder);
- `builders`: the tiny random-weight diffusers directories, built in code;
- `tokenizers`: the tokenizers they carry, learnt in code;
- `published`: the published models at full size with random weights (the GPU check).
"""
