"""Device memory that can be given back to the device and taken again: one region per kind (weights, KV cache).

A region is one flat uint8 tensor; the weights and the KV cache live as views into it, so a release frees them all
at once and the views stay valid Python objects. On CUDA the region is reserved through the driver's virtual memory
API (`VmmRegion`): a restore maps new physical memory at the same addresses, so CUDA graphs captured before a sleep
replay correctly after it. Elsewhere (CPU, or where the driver API is not usable) `TorchRegion` resizes the tensor's
storage to nothing and back: the storage object stays, so every view follows it, but its address may change, and
the engine recaptures its CUDA graphs (`ModelRunner.recapture_graphs_if_moved`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tidal.worker.memory import cuda_vmm

# Physical memory is created in pieces of this size: a large cache need not find one contiguous piece.
VMM_CHUNK_BYTES = 2 * 2**30


class DeviceRegion(ABC):
    """`tensor` (uint8 [nbytes]) may be read and written only while `is_resident`."""

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
    def _restore(self, num_pieces: int | None) -> None: ...

    def release(self) -> None:
        """Give the memory back to the device (the content is lost)."""
        if not self.is_resident:
            self.discard_prepared()
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing may still read or write it
        self._release()
        self.is_resident = False

    def restore(self, num_pieces: int | None = None) -> None:
        """Take memory again (uninitialised content): its first `num_pieces` pieces (all when None) where the
        region maps in pieces (VmmRegion with a piece list); `restore_rest` maps the others later."""
        if self.is_resident:
            return
        self._restore(num_pieces)
        self.is_resident = True

    def restore_rest(self) -> None:  # noqa: B027 -- only regions mapped in pieces have a rest
        """Map what a partial `restore` left out (nothing where a restore is always whole)."""

    @property
    def is_complete(self) -> bool:
        """Resident, and every piece of it mapped."""
        return self.is_resident

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

    def _restore(self, num_pieces: int | None) -> None:
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
    """`pieces` (offsets and sizes, multiples of the granularity, in the order a restore maps them) may leave gaps
    that are never mapped; by default the region is cut into VMM_CHUNK_BYTES pieces."""

    def __init__(self, nbytes: int, device: torch.device, pieces: list[tuple[int, int]] | None = None) -> None:
        super().__init__(nbytes, device)
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(self._index):
            torch.cuda.synchronize()  # makes the primary context current on this thread for the driver calls
            gran = cuda_vmm.granularity(self._index)
            self._size = -(-max(nbytes, 1) // gran) * gran
            if pieces is None:
                chunk = max(gran, VMM_CHUNK_BYTES // gran * gran)
                pieces = [(start, min(chunk, self._size - start)) for start in range(0, self._size, chunk)]
            bad = [p for p in pieces if p[0] % gran or p[1] % gran or p[1] <= 0 or p[0] + p[1] > self._size]
            if bad:
                raise ValueError(f"pieces {bad[:3]} are not whole granules ({gran} bytes) inside {self._size} bytes")
            self._base = cuda_vmm.reserve(self._size, gran)
            self._pieces = [(self._base + offset, size) for offset, size in pieces]
            self._handles: list[tuple[int, int, int]] = []  # (address, size, handle) of each mapped piece, in order
            self._prepared: dict[int, int] = {}  # piece index -> physical memory created ahead of a restore
            tensor: torch.Tensor | None = None
            try:
                self._map_pieces(len(self._pieces))
                # The device must be named: without it as_tensor copies the data to the default (CPU) device.
                tensor = torch.as_tensor(_CudaPointer(self._base, nbytes), device=torch.device("cuda", self._index))
                if tensor.data_ptr() != self._base:
                    raise RuntimeError("torch wrapped the reserved range at another address")
            except Exception:
                tensor = None  # no tensor may outlive the memory it points to
                self._unmap_all()
                cuda_vmm.free_reservation(self._base, self._size)
                raise
            self._tensor = tensor

    @property
    def tensor(self) -> torch.Tensor:
        return self._tensor

    @property
    def is_complete(self) -> bool:
        return self.is_resident and len(self._handles) == len(self._pieces)

    def _map_pieces(self, upto: int) -> None:
        """Map pieces [mapped so far, upto). On failure the pieces this call mapped are given back."""
        start = len(self._handles)
        for i in range(start, upto):
            address, size = self._pieces[i]
            handle = self._prepared.pop(i, None)
            try:
                if handle is None:
                    handle = cuda_vmm.create(size, self._index)
                cuda_vmm.map_created(address, size, handle, self._index)
            except BaseException:
                if handle is not None:
                    cuda_vmm.release(handle)
                self._unmap_from(start)
                raise
            self._handles.append((address, size, handle))

    def prepare_restore(self) -> None:
        """Create the physical memory now and map it at `restore`. (Measured on an H200: creating does not overlap
        a copy in flight, so this buys nothing during a wake; benchmarks/lifecycle_wake_breakdown.py.)"""
        if self.is_resident or self._prepared:
            return
        cuda_vmm.make_current(self._index)
        try:
            for i, (_, size) in enumerate(self._pieces):
                self._prepared[i] = cuda_vmm.create(size, self._index)
        except BaseException:
            self.discard_prepared()
            raise

    def discard_prepared(self) -> None:
        prepared, self._prepared = self._prepared, {}
        for handle in prepared.values():
            cuda_vmm.release(handle)

    def _unmap_from(self, start: int) -> None:
        for address, size, handle in self._handles[start:]:
            cuda_vmm.unmap_and_release(address, size, handle)
        del self._handles[start:]

    def _unmap_all(self) -> None:
        self._unmap_from(0)

    def _release(self) -> None:
        cuda_vmm.make_current(self._index)
        self._unmap_all()

    def _restore(self, num_pieces: int | None) -> None:
        # No synchronisation: mapping can overlap a copy already queued into another region.
        cuda_vmm.make_current(self._index)
        upto = len(self._pieces) if num_pieces is None else min(num_pieces, len(self._pieces))
        try:
            self._map_pieces(upto)
        except BaseException:
            # E.g. out of memory half-way through a wake: hold none of it, and leave the range free for a retry.
            self._unmap_all()
            self.discard_prepared()
            raise

    def restore_rest(self) -> None:
        """Map the pieces a partial restore left; on failure (out of memory: another process took it while this
        one slept) what was mapped before stays, and a later call may try again."""
        if not self.is_resident:
            raise RuntimeError("restore_rest before restore")
        cuda_vmm.make_current(self._index)
        self._map_pieces(len(self._pieces))


def free_cached_device_memory(device: torch.device) -> None:
    """Return torch's cached free blocks (activations of the last steps) to the device."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
