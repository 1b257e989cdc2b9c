"""Batch-invariant kernels: a sample's bits do not depend on how many others share its call.

Stock kernels choose how to block a computation, and with it the order of their sums, from the
shape of the whole call. Measured on this project's CPU (torch 2.13, 2 threads): `F.linear` gives a
row three different results in calls of 1, of 2-3 and of 4 or more rows; a convolution and group
norm give an image other bits alone than beside other images. There are two ways to make a sample's
bits independent of its companions (`BatchInvariance`):

- `PADDING`, the default: every call takes exactly the micro-batch's rows, padded, so every call
  has the same shape and the stock kernels do the same thing each time. A lone sample pays for the
  whole micro-batch.
- `KERNELS`: a call takes the rows there are, and `FixedBlockKernels` runs, inside it, every
  operation whose kernel depends on the call's shape on shapes that do not:
  - `F.linear` over its input's rows (every sample's tokens, flattened) in blocks of exactly
    `block_rows` rows, the last one zero-padded. Each block is the same `(block_rows, K) x (K, N)`
    product, and a kernel computes a row of a product of fixed shape the same way whatever the
    other rows hold and wherever the row sits.
  - convolutions, group norm and attention one sample at a time, with shape `(1, ...)`: they mix
    values within a sample (a kernel window, a group, the keys), and their kernels are chosen for
    the whole batch.
  What else these transformers and VAEs run (layer norm and RMS norm over the last dimension,
  softmax, elementwise operations) computes a row from that row alone.

The argument is checked, not trusted: the tests compare every family's velocity and decoded image
of a sample alone, at another position and in calls of 2 to 16 rows, bit for bit, on CPU; and
`rollout.calibration.check_batch_invariance` makes the same comparison on the serving device before
a worker serves in this mode (a new family, another device or another torch build may break it).

Thinking Machines' batch_invariant_ops and the deterministic modes of vLLM and SGLang do the same on
CUDA with Triton kernels of one fixed tiling for matmul, attention and reductions; with stock
kernels, fixed shapes are what fixes the tiling.
"""

from __future__ import annotations

import contextlib
import enum
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# Token rows per linear block: a lone sample at the smallest image sizes (64 image tokens) fills one.
DEFAULT_BLOCK_ROWS = 64


class BatchInvariance(str, enum.Enum):
    """What keeps a sample's bits independent of the other samples in its model calls."""

    PADDING = "padding"  # calls of exactly the micro-batch's rows, padded; stock kernels
    KERNELS = "kernels"  # calls of the rows there are; `FixedBlockKernels`


# Operations that mix values within a sample, run one sample at a time: the parameters, in
# positional order, that carry the batch as their leading dimension.
_PER_SAMPLE: dict[Callable, tuple[str, ...]] = {
    F.conv1d: ("input",),
    F.conv2d: ("input",),
    F.conv3d: ("input",),
    F.conv_transpose1d: ("input",),
    F.conv_transpose2d: ("input",),
    F.conv_transpose3d: ("input",),
    F.group_norm: ("input",),
    F.scaled_dot_product_attention: ("query", "key", "value", "attn_mask"),
}


class FixedBlockKernels(TorchFunctionMode):
    """While active (`with FixedBlockKernels():`, in this thread only), linear layers run in fixed
    blocks of `block_rows` rows and convolutions, group norm and attention one sample at a time;
    see the module's docstring. Results are differentiable, as the stock operations'."""

    def __init__(self, block_rows: int = DEFAULT_BLOCK_ROWS):
        super().__init__()
        if isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows < 1:
            raise ValueError(f"block_rows must be an integer >= 1, got {block_rows!r}")
        self.block_rows = block_rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # The mode is off while its handler runs, so the calls below reach the stock kernels.
        if func is F.linear:
            return linear_in_blocks(*args, block_rows=self.block_rows, **kwargs)
        if func in _PER_SAMPLE:
            return _one_sample_at_a_time(func, _PER_SAMPLE[func], args, kwargs)
        return func(*args, **kwargs)


def linear_in_blocks(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, block_rows: int
) -> torch.Tensor:
    """`F.linear(input, weight, bias)`, computed as products of exactly `block_rows` rows."""
    # (M, K): every sample's tokens, in one layout whatever the input's strides (see `_one_sample_at_a_time`).
    rows = input.reshape(-1, input.shape[-1]).contiguous()
    count = rows.shape[0]
    if count == 0:
        return F.linear(input, weight, bias)
    missing = -count % block_rows
    padded = torch.cat([rows, rows.new_zeros((missing, rows.shape[1]))]) if missing else rows
    blocks = [F.linear(padded[start : start + block_rows], weight, bias) for start in range(0, len(padded), block_rows)]
    output = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    return output[:count].reshape(*input.shape[:-1], weight.shape[0])


def _one_sample_at_a_time(func: Callable, batched: tuple[str, ...], args: tuple, kwargs: dict[str, Any]) -> Any:
    leading = args[0] if args else kwargs[batched[0]]
    size = leading.shape[0]

    def sample(value, i: int):
        # Each sample in the contiguous layout: for one sample the strides of a channels-last and a
        # contiguous tensor can both pass for either layout, and a kernel that picks its code by
        # layout then computes the same values two ways (seen: group norm in a VAE decoder, whose
        # layout followed the batch size). A tensor broadcast over the batch (an attention mask
        # with fewer dimensions, or a leading dimension of 1) holds for every sample as it is.
        if isinstance(value, torch.Tensor) and value.dim() == leading.dim() and value.shape[0] == size:
            return value[i : i + 1].contiguous()
        return value

    outputs = [
        func(
            *(sample(value, i) if position < len(batched) else value for position, value in enumerate(args)),
            **{name: sample(value, i) if name in batched else value for name, value in kwargs.items()},
        )
        for i in range(size)
    ]
    return outputs[0] if size == 1 else torch.cat(outputs)


def kernels_for(invariance: BatchInvariance, block_rows: int = DEFAULT_BLOCK_ROWS) -> contextlib.AbstractContextManager:
    """The context model calls run in: `FixedBlockKernels` for `KERNELS`, nothing for `PADDING`."""
    if invariance is BatchInvariance.KERNELS:
        return FixedBlockKernels(block_rows)
    if invariance is BatchInvariance.PADDING:
        return contextlib.nullcontext()
    raise ValueError(f"unknown batch invariance {invariance!r}")
