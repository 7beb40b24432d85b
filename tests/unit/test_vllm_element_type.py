"""The element type of a vLLM KV cache: fp8 caches (uint8 tensors) are float8, other quantized
caches are refused with a reason (the connector then turns itself off; vLLM still serves)."""

from __future__ import annotations

import pytest
import torch

from kvd.connectors.vllm.layout import UnsupportedLayout, element_type
from kvd.core.keys import DType


@pytest.mark.parametrize(("dtype", "cache_dtype", "expected"), [
    (torch.uint8, "fp8", DType.FLOAT8_E4M3),
    (torch.uint8, "fp8_e4m3", DType.FLOAT8_E4M3),
    (torch.uint8, "fp8_e5m2", DType.FLOAT8_E5M2),
    (torch.float8_e4m3fn, "fp8", DType.FLOAT8_E4M3),
    (torch.bfloat16, "auto", DType.BFLOAT16),
    (torch.float16, "float16", DType.FLOAT16),
    (torch.float32, "auto", DType.FLOAT32),
])
def test_a_plain_or_fp8_cache_has_its_element_type(dtype, cache_dtype, expected):
    assert element_type(dtype, cache_dtype) == expected


@pytest.mark.parametrize(("dtype", "cache_dtype"), [
    (torch.uint8, "fp8_inc"),      # Gaudi's fp8: not one of the formats named above
    (torch.uint8, "fp8_ds_mla"),   # DeepSeek's packed latent: fp8 values with their scales inline
    (torch.uint8, "auto"),         # one-byte tensors with no format named
    (torch.int8, "int8"),
])
def test_any_other_quantized_cache_is_refused_with_its_name(dtype, cache_dtype):
    with pytest.raises(UnsupportedLayout, match=f"kv_cache_dtype '{cache_dtype}'"):
        element_type(dtype, cache_dtype)
