"""CUDA virtual memory management through the driver API (ctypes, no extension to build).

A virtual address range is reserved once; physical memory is created and mapped into it, and unmapped and released
again to give it back to the device. Tensors built over the range keep their addresses across a release and a
re-map, so CUDA graphs that captured them stay valid after a sleep.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

_SUCCESS = 0
_ALLOCATION_TYPE_PINNED = 1
_LOCATION_TYPE_DEVICE = 1
_ACCESS_READWRITE = 3
_GRANULARITY_RECOMMENDED = 1


class CudaDriverError(RuntimeError):
    pass


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


@functools.cache
def _driver() -> ctypes.CDLL:
    name = ctypes.util.find_library("cuda") or "libcuda.so.1"
    try:
        return ctypes.CDLL(name)
    except OSError as err:
        raise CudaDriverError(f"cannot load the CUDA driver library ({name}): {err}") from err


def _check(result: int, what: str) -> None:
    if result != _SUCCESS:
        message = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(message))
        text = message.value.decode() if message.value else "unknown error"
        raise CudaDriverError(f"{what} failed: CUDA error {result} ({text})")


def _prop(device_index: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = _ALLOCATION_TYPE_PINNED
    prop.location = _Location(_LOCATION_TYPE_DEVICE, device_index)
    return prop


@functools.cache
def _primary_context(device_index: int) -> int:
    ctx = ctypes.c_void_p()
    _check(
        _driver().cuDevicePrimaryCtxRetain(ctypes.byref(ctx), ctypes.c_int(device_index)), "cuDevicePrimaryCtxRetain"
    )
    return int(ctx.value or 0)


def make_current(device_index: int) -> None:
    """Make the device's primary context (the one torch uses) current on this thread, without synchronising."""
    _check(_driver().cuCtxSetCurrent(ctypes.c_void_p(_primary_context(device_index))), "cuCtxSetCurrent")


def granularity(device_index: int) -> int:
    value = ctypes.c_size_t()
    prop = _prop(device_index)
    _check(
        _driver().cuMemGetAllocationGranularity(ctypes.byref(value), ctypes.byref(prop), _GRANULARITY_RECOMMENDED),
        "cuMemGetAllocationGranularity",
    )
    return int(value.value)


def reserve(size: int, alignment: int) -> int:
    """-> base address of a reserved (unbacked) virtual range of `size` bytes."""
    ptr = ctypes.c_uint64()
    _check(
        _driver().cuMemAddressReserve(
            ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(alignment), ctypes.c_uint64(0), ctypes.c_uint64(0)
        ),
        "cuMemAddressReserve",
    )
    return int(ptr.value)


def free_reservation(base: int, size: int) -> None:
    _check(_driver().cuMemAddressFree(ctypes.c_uint64(base), ctypes.c_size_t(size)), "cuMemAddressFree")


def create(size: int, device_index: int) -> int:
    """New physical memory of `size` bytes on the device, not yet mapped anywhere. -> the handle."""
    handle = ctypes.c_uint64()
    prop = _prop(device_index)
    _check(
        _driver().cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_uint64(0)),
        "cuMemCreate",
    )
    return int(handle.value)


def release(handle: int) -> None:
    """Give back physical memory that is not mapped (or whose mappings are all gone)."""
    _check(_driver().cuMemRelease(ctypes.c_uint64(handle)), "cuMemRelease")


def map_created(base: int, size: int, handle: int, device_index: int) -> None:
    """Map the physical memory `handle` at [base, base + size), readable and writable from the device. On failure
    nothing stays mapped; the handle is still the caller's."""
    lib = _driver()
    no_offset, no_flags = ctypes.c_size_t(0), ctypes.c_uint64(0)
    _check(
        lib.cuMemMap(ctypes.c_uint64(base), ctypes.c_size_t(size), no_offset, ctypes.c_uint64(handle), no_flags),
        "cuMemMap",
    )
    access = _AccessDesc(_Location(_LOCATION_TYPE_DEVICE, device_index), _ACCESS_READWRITE)
    try:
        _check(
            lib.cuMemSetAccess(ctypes.c_uint64(base), ctypes.c_size_t(size), ctypes.byref(access), ctypes.c_size_t(1)),
            "cuMemSetAccess",
        )
    except CudaDriverError:
        lib.cuMemUnmap(ctypes.c_uint64(base), ctypes.c_size_t(size))
        raise


def create_and_map(base: int, size: int, device_index: int) -> int:
    """Back [base, base + size) with new physical memory, readable and writable from the device. -> the handle."""
    handle = create(size, device_index)
    try:
        map_created(base, size, handle, device_index)
    except CudaDriverError:  # the caller never learns the handle: give the memory back here
        release(handle)
        raise
    return handle


def unmap_and_release(base: int, size: int, handle: int) -> None:
    """Give the physical memory behind [base, base + size) back to the device; the reservation stays."""
    lib = _driver()
    _check(lib.cuMemUnmap(ctypes.c_uint64(base), ctypes.c_size_t(size)), "cuMemUnmap")
    _check(lib.cuMemRelease(ctypes.c_uint64(handle)), "cuMemRelease")
