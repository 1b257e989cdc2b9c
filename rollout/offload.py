"""Weights moved out of accelerator memory and back (SGLang's `release_memory_occupation` and
`resume_memory_occupation`): every parameter and buffer of a set of modules copied into host
memory of its own, and from there back onto the device.

On a GPU the host copies are page-locked (pinned) and kept for the life of the modules: a copy
from pageable memory is staged through a driver buffer and runs at a fraction of the bus's speed
(SGLang measured 2.8 GB/s on an H200), and pinning is itself slow, so it is paid once, at the first
release. The weights written while released (an update applied meanwhile) are the host copies, so
they are what comes back.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import nn


class HostCopies:
    """The host copies of `modules`' tensors, which `to_host` moves the modules onto and `to_device`
    moves them back from."""

    def __init__(self, modules: Mapping[str, nn.Module], device: torch.device):
        self.modules, self.device = modules, device
        self._pinned = device.type == "cuda"
        self._host: dict[object, torch.Tensor] = {}  # a parameter's id, or a buffer's (module id, name) -> its copy

    def to_host(self) -> int:
        """Moves every tensor to its host copy; returns the bytes moved."""
        moved, kept = [], {}
        for key, owner, name, tensor in self._tensors():
            host = self._host.get(key)
            if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._pinned)
            host.copy_(tensor.detach(), non_blocking=self._pinned)
            moved.append((owner, name, host))
            kept[key] = host
        self._host = kept  # (the copies of tensors no longer held, an adapter's removed since, go)
        self._synchronize()  # every copy landed before the device memory is let go
        for owner, name, host in moved:
            _point(owner, name, host)
        if self._pinned:
            torch.cuda.empty_cache()
        return sum(host.nbytes for _, _, host in moved)

    def to_device(self) -> int:
        """Moves every tensor back onto the device from its host copy; returns the bytes moved."""
        moved = [(owner, name, tensor.to(self.device, non_blocking=self._pinned)) for _, owner, name, tensor in self._tensors()]
        self._synchronize()
        for owner, name, on_device in moved:
            _point(owner, name, on_device)
        return sum(t.nbytes for _, _, t in moved)

    def _tensors(self) -> Iterator[tuple[object, nn.Module, str, torch.Tensor]]:
        """Each parameter once (a tied one is one tensor) and each buffer, with the module holding it."""
        seen: set[object] = set()
        for module in self.modules.values():
            for owner in module.modules():
                for name, tensor in (*owner._parameters.items(), *owner._buffers.items()):
                    key = id(tensor) if isinstance(tensor, nn.Parameter) else (id(owner), name)
                    if tensor is None or key in seen:
                        continue
                    seen.add(key)
                    yield key, owner, name, tensor

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _point(owner: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Has `owner`'s parameter or buffer `name` hold `tensor`, as `nn.Module.to` does."""
    if name in owner._parameters:
        owner._parameters[name].data = tensor
    else:
        owner._buffers[name] = tensor
