"""torch <-> kvd dtype mapping. torch is imported when first needed, so
clients that never touch tensors do not pay for it."""

from __future__ import annotations

import functools
from typing import Any

from kvd.core.keys import DType
from kvd.errors import InvalidArgument


@functools.cache
def _torch_by_kvd() -> dict[DType, Any]:
    import torch

    return {
        DType.FLOAT32: torch.float32,
        DType.FLOAT16: torch.float16,
        DType.BFLOAT16: torch.bfloat16,
        DType.FLOAT8_E4M3: torch.float8_e4m3fn,
        DType.FLOAT8_E5M2: torch.float8_e5m2,
        DType.INT8: torch.int8,
    }


def torch_dtype(dtype: int) -> Any:
    return _torch_by_kvd()[DType(dtype)]


def dtype_of_torch(dtype: Any) -> DType:
    """kvd DType of a torch dtype, or of its name as HF configs write it ("bfloat16")."""
    import torch

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    for kvd_type, torch_type in _torch_by_kvd().items():
        if torch_type == dtype:
            return kvd_type
    raise InvalidArgument(f"dtype {dtype!r} has no kvd equivalent")


def rows_to_tensor(array: Any, dtype: int) -> Any:
    """A numpy array of the namespace's storage dtype as a torch tensor of its real dtype."""
    import numpy as np
    import torch

    tensor = torch.from_numpy(np.ascontiguousarray(array))
    target = torch_dtype(dtype)
    if tensor.dtype != target:
        tensor = tensor.view(target)
    return tensor
