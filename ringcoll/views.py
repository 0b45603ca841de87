"""Arrays that are not torch tensors, seen as tensors or as raw device arrays.

The CUDA half takes CuPy arrays (and anything with DLPack or ``__cuda_array_interface__``)
wherever it takes tensors. They are *viewed*, never copied: a copy would silently lose every
write to an output. Two views:

* :func:`tensor_view`: a torch tensor over the same memory, for the ordinary collectives;
* :func:`as_device_array`: (pointer, count, dtype) for the ``*_array`` methods, which run on
  a stream the caller names.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


def tensor_view(array):
    """A torch tensor over the same memory as `array` (DLPack first, which also carries
    bfloat16, else __cuda_array_interface__); tensors and None pass through, anything else
    is left for the collective's own validation to name."""
    if array is None or isinstance(array, torch.Tensor):
        return array
    if hasattr(array, "__dlpack__"):
        return torch.from_dlpack(array, copy=False)  # raises rather than copy
    if hasattr(array, "__cuda_array_interface__"):
        return torch.as_tensor(array)  # no dtype or device given: a view, never a copy
    return array


def cuda_tensor_view(array) -> Optional[torch.Tensor]:
    """A tensor over the memory of a DLPack / __cuda_array_interface__ array on a GPU, else None."""
    if not (hasattr(array, "__dlpack__") or hasattr(array, "__cuda_array_interface__")):
        return None
    try:
        view = tensor_view(array)
    except Exception:  # noqa: BLE001 - not an array torch can view: the CPU validation names it
        return None
    return view if isinstance(view, torch.Tensor) and view.is_cuda else None


class DeviceArray(NamedTuple):
    ptr: int
    count: int
    dtype: torch.dtype


_TYPESTRS = {"<f4": torch.float32, "<f8": torch.float64, "<f2": torch.float16, "|i1": torch.int8,
             "|u1": torch.uint8, "<i4": torch.int32, "<i8": torch.int64}


def as_device_array(array) -> DeviceArray:
    """(pointer, element count, torch dtype) of a torch CUDA tensor or any object with a
    ``__cuda_array_interface__`` (CuPy, Numba, JAX...). Must be C-contiguous. bfloat16 has
    no standard typestr, so it is only accepted from torch tensors."""
    if isinstance(array, torch.Tensor):
        if not array.is_cuda or not array.is_contiguous():
            raise ValueError("array: expected a contiguous CUDA tensor")
        return DeviceArray(array.data_ptr(), array.numel(), array.dtype)
    cai = getattr(array, "__cuda_array_interface__", None)
    if cai is None:
        raise TypeError(f"array: {type(array).__name__} has no __cuda_array_interface__")
    shape = tuple(cai["shape"])
    typestr = cai["typestr"]
    if typestr not in _TYPESTRS:
        raise TypeError(f"array: unsupported typestr {typestr!r}; supported: {', '.join(_TYPESTRS)}")
    dtype = _TYPESTRS[typestr]
    count = 1
    for s in shape:
        count *= s
    strides = cai.get("strides")
    if strides is not None:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        expected, step = [], itemsize
        for s in reversed(shape):
            expected.append(step)
            step *= s
        if tuple(reversed(expected)) != tuple(strides) and count > 1:
            raise ValueError("array: must be C-contiguous")
    return DeviceArray(int(cai["data"][0]), count, dtype)


def check_count(name: str, array: DeviceArray, expected: int) -> None:
    if array.count != expected:
        raise ValueError(f"{name}: array has {array.count} elements, expected {expected}")
