"""Weights moved to host copies and back (`rollout.offload`), as a replica releases and resumes its
memory. Here the device is the CPU, so the copies are not pinned; on a GPU only that differs."""

import copy

import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from rollout.offload import HostCopies
from rollout.weights import weights_checksum


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.to_q = nn.Linear(4, 4)
        self.out = nn.Linear(4, 7, bias=False)
        self.out.weight = self.embed.weight  # one tensor, held by two modules
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))


def storages(module: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}


def test_weights_leave_for_their_host_copies_and_come_back_with_their_bits_and_ties():
    torch.manual_seed(0)
    model = Tied()
    before = copy.deepcopy(model.state_dict())
    copies = HostCopies({"model": model}, torch.device("cpu"))
    on_device = storages(model)

    assert copies.to_host() == sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
    on_host = storages(model)
    assert not on_host & on_device  # every tensor now lives in its host copy
    assert model.out.weight is model.embed.weight
    with torch.no_grad():  # an update applied while released writes the host copies
        model.to_q.weight.add_(1.0)
    copies.to_device()
    assert model.out.weight is model.embed.weight  # (on the CPU, `to(device)` keeps the host copies)
    assert torch.equal(model.to_q.weight, before["to_q.weight"] + 1.0)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items() if k != "to_q.weight")

    # The next release reuses the same host memory (pinning is paid once, on a GPU).
    copies.to_host()
    assert storages(model) == on_host


def test_an_adapter_added_between_releases_goes_and_comes_back_with_the_rest():
    torch.manual_seed(1)
    model = Tied()
    copies = HostCopies({"model": model}, torch.device("cpu"))
    copies.to_host()
    copies.to_device()
    model.add_module("adapted", nn.Linear(4, 4))
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["to_q"]), model)
    checksum = weights_checksum(model)
    copies.to_host()
    assert weights_checksum(model) == checksum
    copies.to_device()
    assert weights_checksum(model) == checksum
