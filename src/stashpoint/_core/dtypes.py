"""The dtypes the format stores, by name, with their sizes and safetensors names: the format's
own table, so that reading a manifest needs no torch."""

from __future__ import annotations

from collections.abc import Sequence

from stashpoint.errors import CorruptCheckpointError

ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "uint16": 2,
    "int16": 2,
    "uint32": 4,
    "int32": 4,
    "uint64": 8,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "bits8": 1,
    "bits16": 2,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
}

# The dtypes safetensors readers know, by their safetensors names; others are listed as bytes.
SAFETENSORS: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
}


def itemsize(name: object, where: str) -> int:
    """The bytes per element of the dtype called ``name``; unknown names are corruption."""
    if not isinstance(name, str) or name not in ITEMSIZE:
        raise CorruptCheckpointError(f"unknown dtype {name!r} in {where}")
    return ITEMSIZE[name]


def safetensors_view(dtype: str, shape: Sequence[int], nbytes: int) -> tuple[str, list[int]]:
    """The (dtype, shape) under which a tensor is listed in a shard's safetensors header.

    Dtypes that safetensors readers do not know are listed as raw bytes (``U8``, 1-D); the
    manifest always holds the true dtype and shape.
    """
    st = SAFETENSORS.get(dtype)
    if st is None:
        return "U8", [nbytes]
    return st, list(shape)
