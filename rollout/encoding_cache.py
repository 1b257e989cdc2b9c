"""Prompt and image encodings kept between requests, per pipeline: RL samples the same prompts every
epoch, and a real family's text encoder (T5-XXL, a Qwen2.5-VL) or VAE encode is paid once per
distinct prompt, image set and size, not once per request.

What a pipeline keeps is what it made, on the host: a hit returns the same tensors a miss would
make (an encoding is a function of its key, `rollout.options.SamplingOptions.for_encoding`, and
of encoder weights that never change: no weight update reaches an encoder). Least recently used
entries go first once the cache holds `max_bytes`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

# Host memory a pipeline keeps encodings in by default: 256 of FLUX.1's T5 prompts (512 tokens of
# 4096 in bf16, 4 MiB each), thousands of the tiny copies'.
ENCODING_CACHE_BYTES = 2**30


class EncodingCache:
    """Encodings (named tensors) by key, at most `max_bytes` of them; 0 keeps none."""

    def __init__(self, max_bytes: int = ENCODING_CACHE_BYTES):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = self.misses = 0
        self._entries: OrderedDict[Hashable, dict[str, torch.Tensor]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable, make: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The encoding kept under `key`, else `make()`'s, kept (on the host) if it fits."""
        kept = self._entries.get(key)
        if kept is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return kept
        self.misses += 1
        made = {name: tensor.detach().cpu() for name, tensor in make().items()}
        size = sum(tensor.nbytes for tensor in made.values())
        if size <= self.max_bytes:
            while self.bytes + size > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self.bytes -= sum(tensor.nbytes for tensor in dropped.values())
            self._entries[key] = made
            self.bytes += size
        return made
