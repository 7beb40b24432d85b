"""torch <-> kvd dtype mapping (torch imported lazily by the callers)."""

from __future__ import annotations

from typing import Any

from kvd.core.keys import DType


def torch_dtype(dtype: int) -> Any:
    import torch

    return {
        DType.FLOAT32: torch.float32,
        DType.FLOAT16: torch.float16,
        DType.BFLOAT16: torch.bfloat16,
        DType.FLOAT8_E4M3: torch.float8_e4m3fn,
        DType.FLOAT8_E5M2: torch.float8_e5m2,
        DType.INT8: torch.int8,
    }[DType(dtype)]


def dtype_of_torch(dtype: Any) -> DType:
    import torch

    mapping = {
        torch.float32: DType.FLOAT32,
        torch.float16: DType.FLOAT16,
        torch.bfloat16: DType.BFLOAT16,
        torch.float8_e4m3fn: DType.FLOAT8_E4M3,
        torch.float8_e5m2: DType.FLOAT8_E5M2,
        torch.int8: DType.INT8,
    }
    if dtype not in mapping:
        raise ValueError(f"kvd cannot store KV of dtype {dtype}")
    return mapping[dtype]


def rows_to_tensor(array: Any, dtype: int) -> Any:
    """A numpy array of the namespace's storage dtype as a torch tensor of its real dtype."""
    import numpy as np
    import torch

    tensor = torch.from_numpy(np.ascontiguousarray(array))
    target = torch_dtype(dtype)
    if tensor.dtype != target:
        tensor = tensor.view(target)
    return tensor
