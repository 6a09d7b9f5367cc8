"""The safetensors dtypes: each one's size, and the torch dtype it reads as.

One table for the header parser (sizes, no torch needed) and for the tensor sinks (the
torch dtype and shape): a dtype the format defines but this torch lacks is a clear error
when a tensor of it is read, never a crash.

Sizes are in bits, as safetensors counts them: a tensor of ``n`` elements of ``bits``
bits holds ``n * bits / 8`` bytes, and must end on a byte boundary. A sub-byte dtype that
torch packs (``F4`` as ``float4_e2m1fn_x2``, two values a byte) reads with the header's
shape, last dimension divided by ``packed``: the shape ``safetensors.torch`` gives it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# torch sizes are signed 64-bit: a larger dimension cannot be a torch shape.
TORCH_MAX_DIM = 2**63 - 1


@dataclass(frozen=True)
class DType:
    name: str  # as the safetensors header spells it
    bits: int  # bits per element
    torch_name: str | None  # the attribute of the ``torch`` module; None: torch has none
    packed: int = 1  # header elements per torch element (along the last dimension)

    def torch_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape a tensor of ``shape`` has in torch; ValueError saying why it has none."""
        if self.packed != 1:
            if not shape or shape[-1] % self.packed:
                raise ValueError(
                    f"torch packs {self.packed} {self.name} values per element, so the last "
                    f"dimension of shape {list(shape)} must be divisible by {self.packed}"
                )
            shape = (*shape[:-1], shape[-1] // self.packed)
        if any(d > TORCH_MAX_DIM for d in shape):
            raise ValueError(f"shape {list(shape)} has a dimension above torch's {TORCH_MAX_DIM}")
        return tuple(shape)


DTYPES: Mapping[str, DType] = {
    d.name: d
    for d in (
        DType("BOOL", 8, "bool"),
        DType("F4", 4, "float4_e2m1fn_x2", packed=2),
        DType("F6_E2M3", 6, None),
        DType("F6_E3M2", 6, None),
        DType("U8", 8, "uint8"),
        DType("I8", 8, "int8"),
        DType("F8_E5M2", 8, "float8_e5m2"),
        DType("F8_E4M3", 8, "float8_e4m3fn"),
        DType("F8_E8M0", 8, "float8_e8m0fnu"),
        DType("F8_E4M3FNUZ", 8, "float8_e4m3fnuz"),
        DType("F8_E5M2FNUZ", 8, "float8_e5m2fnuz"),
        DType("I16", 16, "int16"),
        DType("U16", 16, "uint16"),
        DType("F16", 16, "float16"),
        DType("BF16", 16, "bfloat16"),
        DType("I32", 32, "int32"),
        DType("U32", 32, "uint32"),
        DType("F32", 32, "float32"),
        DType("C64", 64, "complex64"),
        DType("F64", 64, "float64"),
        DType("I64", 64, "int64"),
        DType("U64", 64, "uint64"),
    )
}
