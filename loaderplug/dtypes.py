"""The safetensors dtypes: each one's size, and the torch dtype it reads as.

One table for the header parser (sizes, no torch needed) and for the tensor sinks (the
torch dtype): a dtype the format defines but this torch lacks is a clear error when a
tensor of it is read, never a crash.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str  # as the safetensors header spells it
    itemsize: int  # bytes per element
    torch_name: str  # the attribute of the ``torch`` module


DTYPES: Mapping[str, DType] = {
    d.name: d
    for d in (
        DType("BOOL", 1, "bool"),
        DType("U8", 1, "uint8"),
        DType("I8", 1, "int8"),
        DType("F8_E5M2", 1, "float8_e5m2"),
        DType("F8_E4M3", 1, "float8_e4m3fn"),
        DType("F8_E4M3FNUZ", 1, "float8_e4m3fnuz"),
        DType("F8_E5M2FNUZ", 1, "float8_e5m2fnuz"),
        DType("F8_E8M0", 1, "float8_e8m0fnu"),
        DType("I16", 2, "int16"),
        DType("U16", 2, "uint16"),
        DType("F16", 2, "float16"),
        DType("BF16", 2, "bfloat16"),
        DType("I32", 4, "int32"),
        DType("U32", 4, "uint32"),
        DType("F32", 4, "float32"),
        DType("C64", 8, "complex64"),
        DType("I64", 8, "int64"),
        DType("U64", 8, "uint64"),
        DType("F64", 8, "float64"),
    )
}
