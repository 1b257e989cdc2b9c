"""Batch-invariant kernels: a sample's bits do not depend on how many others share its call.

Stock kernels choose how to block a computation, and with it the order of their sums, from the
shape of the whole call. Measured on this project's CPU (torch 2.13, 2 threads): `F.linear` gives a
row three different results in calls of 1, of 2-3 and of 4 or more rows; a convolution and group
norm give an image other bits alone than beside other images. There are two ways to make a sample's
bits independent of its companions (`BatchInvariance`):

- `PADDING`, the default: every call takes exactly the micro-batch's rows, padded, so every call
  has the same shape and the stock kernels do the same thing each time. A lone sample pays for the
  whole micro-batch. Where a sample sits in the call still depends on its companions, so this holds
  only at sizes whose calls treat every row alike: on this CPU with 2 threads, not calls of 3, 5 or
  6 rows (`rollout.calibration.check_batch_invariance` checks a size on the serving device).
- `KERNELS`: a call takes the rows there are, and `BatchInvariantKernels` runs, inside it, every
  operation whose kernel depends on the call's shape one sample at a time: a call of the shape a
  sample alone has, on the same values, computes the same bits. Those operations are the linear
  layers, convolutions, group norm, attention and means over a sample's own dimensions (RMS norm:
  on CUDA a reduction's kernel is chosen for the number of rows). What else these transformers and
  VAEs run (elementwise operations, layer norm and softmax over the last dimension) computes a row
  from that row alone, and is left batched. Where one call holds the branches of classifier-free
  guidance, rows [negative; positive] (`branches_in_one_call`), a sample is its rows in both
  branches, run as one call of two rows, as the pipeline runs a lone guided sample: a call of a
  fixed shape, so again the same bits whatever the companions.

The argument is checked, not trusted: the tests compare every family's velocity and decoded image
of a sample alone, at other positions and in calls of 2 to 6 rows, bit for bit, on CPU; and
`rollout.calibration.check_batch_invariance` makes the same comparison on the serving device before
a worker serves in this mode (a new family, another device or another torch build may break it).

Thinking Machines' batch_invariant_ops and the deterministic modes of vLLM and SGLang get the same
guarantee on CUDA with Triton kernels of one fixed tiling for matmul, attention and reductions, so
that even a token's rows can share a call; with stock kernels, a fixed shape is what fixes the
tiling, and a sample's own shape is the one that costs no padding.

Which attention kernel runs is pinned too (`AttentionBackend`): PyTorch picks among its SDPA
kernels per call (flash, memory-efficient, cuDNN, math), each with its own bits, and may pick
another for a forward under autograd than without it. A pipeline runs its denoisers' attention
under the one backend it was loaded with, in the rollout and in `rollout.replay` alike, so a
trainer that loads its pipeline with the server's backend replays with the server's kernel.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from rollout.errors import ModelLoadError


class BatchInvariance(str, enum.Enum):
    """What keeps a sample's bits independent of the other samples in its model calls."""

    PADDING = "padding"  # calls of exactly the micro-batch's rows, padded; stock kernels
    KERNELS = "kernels"  # calls of the rows there are; `BatchInvariantKernels`


class AttentionBackend(str, enum.Enum):
    """The SDPA kernel a pipeline's denoisers run (`model.attention_backend`): "default" leaves the
    choice to PyTorch, call by call; the others pin one, for the rollout and its replay."""

    DEFAULT = "default"
    MATH = "math"
    FLASH = "flash"
    EFFICIENT = "efficient"
    CUDNN = "cudnn"

    def running(self) -> contextlib.AbstractContextManager:
        """Within it, attention runs this backend's kernel (or fails, where it cannot run a call)."""
        if self is AttentionBackend.DEFAULT:
            return contextlib.nullcontext()
        return sdpa_kernel([_SDPA_BACKENDS[self]])

    @classmethod
    def checked(cls, name: str, device: torch.device | str, dtype: torch.dtype) -> "AttentionBackend":
        """`name` as a backend that runs on `device` in `dtype` (one small attention call under it);
        raises `ModelLoadError` naming ``model.attention_backend`` otherwise."""
        try:
            backend = cls(name)
        except ValueError:
            raise ModelLoadError(
                "model.attention_backend", f"must be one of {[b.value for b in cls]}, got {name!r}"
            ) from None
        probe = torch.zeros(1, 1, 2, 8, device=device, dtype=dtype)
        try:
            with backend.running():
                F.scaled_dot_product_attention(probe, probe, probe)
        except RuntimeError:
            raise ModelLoadError(
                "model.attention_backend", f"{name!r} has no {dtype} kernel on {torch.device(device).type} in this torch build"
            ) from None
        return backend


_SDPA_BACKENDS = {
    AttentionBackend.MATH: SDPBackend.MATH,
    AttentionBackend.FLASH: SDPBackend.FLASH_ATTENTION,
    AttentionBackend.EFFICIENT: SDPBackend.EFFICIENT_ATTENTION,
    AttentionBackend.CUDNN: SDPBackend.CUDNN_ATTENTION,
}


# Operations run one sample at a time: the parameters, in positional order, that carry the batch
# as their leading dimension, and the fewest dimensions the first one has when it has a batch (an
# unbatched input, a single vector or image, is left as it is).
_PER_SAMPLE: dict[Callable, tuple[tuple[str, ...], int]] = {
    F.linear: (("input",), 2),
    F.conv1d: (("input",), 3),
    F.conv2d: (("input",), 4),
    F.conv3d: (("input",), 5),
    F.conv_transpose1d: (("input",), 3),
    F.conv_transpose2d: (("input",), 4),
    F.conv_transpose3d: (("input",), 5),
    F.group_norm: (("input",), 2),
    F.scaled_dot_product_attention: (("query", "key", "value", "attn_mask"), 3),
}
_MEANS = (torch.mean, torch.Tensor.mean)
# How many blocks of the same samples a model call's rows are (`branches_in_one_call`).
_BRANCHES: contextvars.ContextVar[int] = contextvars.ContextVar("branches", default=1)


@contextlib.contextmanager
def branches_in_one_call(branches: int) -> Iterator[None]:
    """Within it, a model call's rows are `branches` blocks of the same samples in the same order
    (classifier-free guidance in one call: [negative; positive]), and `BatchInvariantKernels` runs
    a sample's rows of every block together. Measured on an H200: a guided SD3.5-Medium sample alone
    ran at 0.48 of the pipeline's speed with its two rows in two calls (docs/real_models.md)."""
    token = _BRANCHES.set(branches)
    try:
        yield
    finally:
        _BRANCHES.reset(token)


class BatchInvariantKernels(TorchFunctionMode):
    """While active (`with BatchInvariantKernels():`, in this thread only), the operations whose
    kernels depend on the call's shape run one sample at a time; see the module's docstring.
    Results are differentiable, as the stock operations'."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # The mode is off while its handler runs, so the calls below reach the stock kernels.
        if func in _PER_SAMPLE:
            batched, batched_dims = _PER_SAMPLE[func]
            if _leading(batched, args, kwargs).dim() >= batched_dims:
                return _one_sample_at_a_time(func, batched, args, kwargs)
        elif func in _MEANS and _reduces_within_samples(args, kwargs):
            return _one_sample_at_a_time(func, ("input",), args, kwargs)
        return func(*args, **kwargs)


def _leading(batched: tuple[str, ...], args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
    """The first batched parameter's value."""
    return args[0] if args else kwargs[batched[0]]


def _reduces_within_samples(args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether a mean's dimensions leave the leading (batch) dimension out."""
    tensor = args[0] if args else kwargs.get("input")
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2 or dims is None:
        return False
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    return bool(dims) and all(dim % tensor.dim() != 0 for dim in dims)


def _one_sample_at_a_time(func: Callable, batched: tuple[str, ...], args: tuple, kwargs: dict[str, Any]) -> Any:
    leading = _leading(batched, args, kwargs)
    size = leading.shape[0]
    branches = _BRANCHES.get()
    if size % branches:  # not the call's rows (a broadcast row, say): a row a call, as without branches
        branches = 1
    samples = size // branches
    if samples == 0:
        return func(*args, **kwargs)

    def sample(value, i: int):
        # Sample i's rows: i, i + samples, ... (one a branch). Each sample in the contiguous layout:
        # for one sample the strides of a channels-last and a contiguous tensor can both pass for
        # either layout, and a kernel that picks its code by layout then computes the same values
        # two ways (seen: group norm in a VAE decoder, whose layout followed the batch size). A
        # tensor broadcast over the batch (an attention mask with fewer dimensions, or a leading
        # dimension of 1) holds for every sample as it is.
        if isinstance(value, torch.Tensor) and value.dim() == leading.dim() and value.shape[0] == size:
            return _with_own_strides(value[i::samples])
        return value

    outputs = [
        func(
            *(sample(value, i) if position < len(batched) else value for position, value in enumerate(args)),
            **{name: sample(value, i) if name in batched else value for name, value in kwargs.items()},
        )
        for i in range(samples)
    ]
    if samples == 1:
        return outputs[0]
    # Back to the call's order: every sample's first branch, then every sample's second, ...
    return torch.stack(outputs, dim=1).flatten(0, 1)


def _with_own_strides(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` with the strides of a contiguous tensor of its shape. `.contiguous()` is not enough:
    a sample's rows sliced from a call of n samples keep a leading stride n times a sample's (a
    dimension of size 1 passes for contiguous with any stride), and `F.linear`'s CPU kernel gives
    other bits for it (seen with torch 2.13: a `(1, 4, 32)` input times a LoRA's `(2, 32)` weight,
    leading stride 256 against 128). Found by `benchmarks.properties` on SD3 and FLUX.1 with a
    served LoRA."""
    own = [1] * tensor.dim()
    for dim in range(tensor.dim() - 2, -1, -1):
        own[dim] = own[dim + 1] * tensor.shape[dim + 1]
    if tensor.stride() == tuple(own):
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def zero_padded(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` with zero rows appended up to `rows` rows: the padding of fixed-size calls, whose
    results for the padded rows are dropped."""
    return torch.cat([tensor, tensor.new_zeros((rows - len(tensor), *tensor.shape[1:]))])


def kernels_for(invariance: BatchInvariance) -> contextlib.AbstractContextManager:
    """The context model calls run in: `BatchInvariantKernels` for `KERNELS`, nothing for `PADDING`."""
    if invariance is BatchInvariance.KERNELS:
        return BatchInvariantKernels()
    if invariance is BatchInvariance.PADDING:
        return contextlib.nullcontext()
    raise ValueError(f"unknown batch invariance {invariance!r}")


class LinearAsWithoutGradients(TorchFunctionMode):
    """`F.linear` under autograd, computing the bits it computes without: what makes a replay that
    trains every weight give the rollout's log-probs.

    On an input of three or more dimensions that is not contiguous (SD3's `to_add_out` is given
    the context tokens' slice of the joint attention's output), PyTorch's linear runs a batched
    product of the strided input without gradients, but folds the input into one matrix product
    of a contiguous copy once the weight requires grad (`matmul`'s fold rule), which sums in
    another order: about 1e-6 apart, measured on this project's CPU. Under this mode such a call
    runs the batched product itself, gradients and all. Every other call is left as it is: a 2-D
    or contiguous input takes the same kernel either way."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            names = ("input", "weight", "bias")
            given = {**dict(zip(names, args)), **kwargs}
            x, weight, bias = given["input"], given["weight"], given.get("bias")
            if x.dim() >= 3 and not x.is_contiguous():
                batched = x.reshape(-1, *x.shape[-2:])
                out = torch.bmm(batched, weight.t().expand(batched.shape[0], *weight.t().shape))
                if bias is not None:
                    out = out + bias
                return out.reshape(*x.shape[:-1], weight.shape[0])
        return func(*args, **kwargs)
