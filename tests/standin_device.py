"""A second device on a CPU-only machine, for testing ``parallel_training: mp`` code paths.

``on_second_device(t)`` returns ``t`` as a tensor that behaves as if it lived on another device: an operation that
mixes it with a tensor of the module's device raises, as it would between two GPUs; moving it with
``.to(device)``/``.cpu()`` brings it back. Autograd flows through it unchanged.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

MISMATCH = "Expected all tensors to be on the same device (stand-in second device)"


class _SecondDevice(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        moves = func is torch.Tensor.cpu or (
            func is torch.Tensor.to
            and any(isinstance(a, (torch.device, str)) for a in (*args[1:], kwargs.get("device")))
        )
        if moves:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs).as_subclass(torch.Tensor)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(not isinstance(t, cls) and t.dim() > 0 for t in tensors):
            raise RuntimeError(MISMATCH)
        return super().__torch_function__(func, types, args, kwargs)


def on_second_device(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_subclass(_SecondDevice)
