"""Device memory that can be given back to the device and taken again: one region per kind (weights, KV cache).

A region is one flat uint8 tensor; the weights and the KV cache live as views into it, so a release frees them all
at once and the views stay valid Python objects. On CUDA the region is reserved through the driver's virtual memory
API (`VmmRegion`): a restore maps new physical memory at the same addresses, so CUDA graphs captured before a sleep
replay correctly after it. Elsewhere (CPU, or where the driver API is not usable) `TorchRegion` resizes the tensor's
storage to nothing and back; its addresses may change, and the owner recaptures what depends on them.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import torch

from tidal.worker.lifecycle import cuda_vmm

log = logging.getLogger(__name__)

# Physical memory is created in pieces of this size: a large cache need not find one contiguous piece.
VMM_CHUNK_BYTES = 2 * 2**30


class DeviceRegion(ABC):
    """`tensor` (uint8 [nbytes]) may be read and written only while `is_resident`."""

    stable_addresses: bool = False

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.device = device
        self.is_resident = True

    @property
    @abstractmethod
    def tensor(self) -> torch.Tensor: ...

    @abstractmethod
    def _release(self) -> None: ...

    @abstractmethod
    def _restore(self) -> None: ...

    def release(self) -> None:
        """Give the memory back to the device (the content is lost)."""
        if not self.is_resident:
            self.discard_prepared()
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing may still read or write it
        self._release()
        self.is_resident = False

    def restore(self) -> None:
        """Take memory again (uninitialised content)."""
        if self.is_resident:
            return
        self._restore()
        self.is_resident = True

    def prepare_restore(self) -> None:  # noqa: B027 -- optional: most regions have nothing to do ahead
        """Do what part of a coming `restore` can run while the device is busy (nothing here; see VmmRegion)."""

    def discard_prepared(self) -> None:  # noqa: B027
        """Give back what `prepare_restore` took, when the restore is not coming after all."""

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()


class TorchRegion(DeviceRegion):
    def __init__(self, nbytes: int, device: torch.device) -> None:
        super().__init__(nbytes, device)
        self._tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)

    @property
    def tensor(self) -> torch.Tensor:
        return self._tensor

    def _release(self) -> None:
        self._tensor.untyped_storage().resize_(0)

    def _restore(self) -> None:
        self._tensor.untyped_storage().resize_(self.nbytes)


class _CudaPointer:
    """Lets torch.as_tensor wrap device memory it does not own (the CUDA array interface)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
            "strides": None,
        }


class VmmRegion(DeviceRegion):
    stable_addresses = True

    def __init__(self, nbytes: int, device: torch.device) -> None:
        super().__init__(nbytes, device)
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(self._index):
            torch.cuda.synchronize()  # makes the primary context current on this thread for the driver calls
            gran = cuda_vmm.granularity(self._index)
            self._chunk = max(gran, VMM_CHUNK_BYTES // gran * gran)
            self._size = -(-max(nbytes, 1) // gran) * gran
            self._base = cuda_vmm.reserve(self._size, gran)
            self._handles: list[tuple[int, int, int]] = []  # (address, size, handle) of each mapped piece
            self._prepared: list[int] = []  # physical pieces created ahead of a restore, not mapped yet
            try:
                self._map_all()
                # The device must be named: without it as_tensor copies the data to the default (CPU) device.
                self._tensor = torch.as_tensor(
                    _CudaPointer(self._base, nbytes), device=torch.device("cuda", self._index)
                )
                if self._tensor.data_ptr() != self._base:
                    raise RuntimeError("torch wrapped the reserved range at another address")
            except Exception:
                self._tensor = None
                self._unmap_all()
                cuda_vmm.free_reservation(self._base, self._size)
                raise

    @property
    def tensor(self) -> torch.Tensor:
        return self._tensor

    def _pieces(self) -> list[tuple[int, int]]:
        return [
            (self._base + start, min(self._chunk, self._size - start)) for start in range(0, self._size, self._chunk)
        ]

    def _map_all(self) -> None:
        prepared, self._prepared = self._prepared, []
        for i, (address, size) in enumerate(self._pieces()):
            handle = prepared[i] if i < len(prepared) else None
            try:
                if handle is None:
                    handle = cuda_vmm.create(size, self._index)
                cuda_vmm.map_created(address, size, handle, self._index)
            except BaseException:
                for unmapped in ([handle] if handle is not None else []) + prepared[i + 1 :]:
                    cuda_vmm.release(unmapped)
                raise
            self._handles.append((address, size, handle))

    def prepare_restore(self) -> None:
        """Create the physical memory now and map it at `restore`. Creating is host-side driver work that can run
        while a copy into another region is in flight; mapping changes the device's page tables and waits for it."""
        if self.is_resident or self._prepared:
            return
        cuda_vmm.make_current(self._index)
        try:
            for _, size in self._pieces():
                self._prepared.append(cuda_vmm.create(size, self._index))
        except BaseException:
            self.discard_prepared()
            raise

    def discard_prepared(self) -> None:
        prepared, self._prepared = self._prepared, []
        for handle in prepared:
            cuda_vmm.release(handle)

    def _unmap_all(self) -> None:
        for address, size, handle in self._handles:
            cuda_vmm.unmap_and_release(address, size, handle)
        self._handles = []

    def _release(self) -> None:
        cuda_vmm.make_current(self._index)
        self._unmap_all()

    def _restore(self) -> None:
        # No synchronisation: mapping can overlap a copy already queued into another region.
        cuda_vmm.make_current(self._index)
        try:
            self._map_all()
        except BaseException:
            # E.g. out of memory half-way through a wake: hold none of it, and leave the range free for a retry.
            self._unmap_all()
            raise


def allocate_region(nbytes: int, device: torch.device, prefer_stable: bool = True) -> DeviceRegion:
    """A VmmRegion on CUDA when the driver API works, else a TorchRegion (logged: its addresses can move)."""
    if device.type == "cuda" and prefer_stable:
        try:
            return VmmRegion(nbytes, device)
        except (cuda_vmm.CudaDriverError, RuntimeError, TypeError) as err:
            log.warning("CUDA virtual memory unavailable (%s): addresses will move across sleep", err)
    return TorchRegion(nbytes, device)
