"""A safetensors dtype as torch knows it: torch imported when a tensor is first made, a
dtype or shape torch cannot hold refused as ``safetensors.torch`` refuses it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loaderplug.errors import FormatError, LoaderplugError
from loaderplug.tensors.format.dtypes import DTYPES
from loaderplug.tensors.format.header import Header, TensorInfo

if TYPE_CHECKING:
    import torch


def torch_module() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise LoaderplugError(
            "reading tensors needs torch: pip install 'loaderplug[torch]'"
        ) from exc
    return torch


def torch_dtype(path: str, name: str, dtype: str) -> torch.dtype:
    known = DTYPES.get(dtype)
    if known is None:
        raise FormatError(f"{path}: tensor {name!r}: unknown dtype {dtype!r}")
    if known.torch_name is None:
        raise FormatError(f"{path}: tensor {name!r}: dtype {dtype} has no torch dtype")
    found = getattr(torch_module(), known.torch_name, None)
    if found is None:
        raise FormatError(
            f"{path}: tensor {name!r}: dtype {dtype} needs torch.{known.torch_name}, "
            f"which this torch ({torch_module().__version__}) lacks"
        )
    return found  # type: ignore[no-any-return]


@dataclass(frozen=True)
class TorchLayout:
    """A header's tensors in the order of their offsets, each with its torch dtype and
    torch shape (see :attr:`TensorInfo.torch_shape`): what making their tensors takes,
    worked out once a file."""

    tensors: list[TensorInfo]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]


# Each safetensors dtype torch has, by its name, and the torch module it is of: looked
# up once a process (again should another torch module stand in).
_known: dict[str, torch.dtype] = {}
_known_of: list[Any] = [None]


def torch_layout(header: Header) -> TorchLayout:
    """The header's :class:`TorchLayout`; a dtype this torch lacks, or a shape torch
    cannot take, fails before any read."""
    module = torch_module()
    if _known_of[0] is not module:
        _known.clear()
        _known_of[0] = module
    layout = TorchLayout([], [], [])
    for t in header.tensors:
        dtype = _known.get(t.dtype)
        if dtype is None:
            dtype = _known.setdefault(t.dtype, torch_dtype(header.path, t.name, t.dtype))
        try:
            shape = DTYPES[t.dtype].torch_shape(t.shape)  # as t.torch_shape will
        except ValueError as exc:
            raise FormatError(f"{header.path}: tensor {t.name!r}: {exc}") from exc
        layout.tensors.append(t)
        layout.dtypes.append(dtype)
        layout.shapes.append(shape)
    return layout


def torch_dtypes(header: Header) -> dict[str, torch.dtype]:
    """Each tensor's torch dtype; a dtype this torch lacks, or a shape torch cannot take
    (see :attr:`TensorInfo.torch_shape`), fails before any read."""
    layout = torch_layout(header)
    return {t.name: dtype for t, dtype in zip(layout.tensors, layout.dtypes, strict=True)}


def empty_tensor(dtype: torch.dtype, t: TensorInfo) -> torch.Tensor:
    """A tensor of no elements; a view, as torch.empty(shape) refuses some such shapes."""
    empty = torch_module().empty(0, dtype=dtype)
    return empty.reshape(t.torch_shape)  # type: ignore[no-any-return]
