"""Pure parts of the lifecycle: region packing, uploads, checksums, collective errors, VMM bookkeeping."""

from __future__ import annotations

import pytest
import torch

from tidal.worker.lifecycle.checksum import overall_digest, tensor_digest, weights_digests
from tidal.worker.lifecycle.errors import (
    BadRequestError,
    CollectiveError,
    UploadNotFoundError,
    UploadOffsetError,
)
from tidal.worker.lifecycle.layout import ALIGNMENT, check_tiling, pack
from tidal.worker.lifecycle.uploads import Uploads


def test_pack_aligns_and_tiling_is_checked():
    offsets, total = pack([10, 300, 1])
    assert offsets == [0, ALIGNMENT, 3 * ALIGNMENT] and total == 4 * ALIGNMENT
    covered = list(zip(offsets, [10, 300, 1], strict=True))
    assert check_tiling([("x", 0, 10), ("y", 256, 300), ("z", 768, 1)], covered) == []
    assert check_tiling([("x", 0, 10), ("y", 5, 300)], covered)[0] == "x and y overlap"
    assert "cover" in check_tiling([("x", 0, 10)], covered)[0]


def test_uploads_append_in_order_and_one_at_a_time(tmp_path):
    uploads = Uploads(tmp_path)
    first = uploads.start(False)
    uploads.write_chunk(first.upload_id, "model.safetensors", 0, b"abc")
    with pytest.raises(UploadOffsetError, match="3 bytes"):
        uploads.write_chunk(first.upload_id, "model.safetensors", 0, b"abc")
    with pytest.raises(BadRequestError):
        uploads.write_chunk(first.upload_id, "../escape.safetensors", 0, b"x")
    second = uploads.start(False)  # replaces the first, whose files are removed
    assert not first.directory.exists()
    with pytest.raises(UploadNotFoundError):
        uploads.get(first.upload_id)
    with pytest.raises(UploadNotFoundError):  # an id from the URL path may be any text: a 404, not a 500
        uploads.write_chunk("caf\u00e9", "model.safetensors", 0, b"x")
    with pytest.raises(BadRequestError, match="no files"):
        uploads.finish(second.upload_id)


def test_checksums_depend_on_bytes_dtype_and_shape_only():
    t = torch.arange(6, dtype=torch.float32)
    assert tensor_digest(t) == tensor_digest(t.clone()) == tensor_digest(torch.arange(8.0)[:6])
    assert tensor_digest(t) != tensor_digest(t.reshape(2, 3))
    assert tensor_digest(t) != tensor_digest(t.to(torch.float64))
    digests = weights_digests({"x": t, "y": t.reshape(2, 3)})
    assert overall_digest(digests) == overall_digest(dict(reversed(list(digests.items()))))


def test_a_trainer_that_cannot_be_reached_is_a_collective_failure():
    from tidal.worker.lifecycle.collective import join_group

    # 502 collective_failed, as the contract says, rather than torch's own error as a 500.
    with pytest.raises(CollectiveError, match="cannot join the trainer's group at 127\\.0\\.0\\.1:1"):
        join_group("127.0.0.1", 1, 1, 2, "gloo", 0.5)


def test_announced_tensor_shapes_are_not_negative():
    from pydantic import ValidationError

    from tidal.contract.control_api import TensorSpec

    assert TensorSpec(name="w", shape=[0, 3], dtype="float32").shape == [0, 3]
    with pytest.raises(ValidationError, match="greater than or equal to 0"):  # else torch.empty fails mid-transfer
        TensorSpec(name="extra", shape=[-1, 4], dtype="float32")


class _FakePhysicalMemory:
    """The driver's physical-memory calls as bookkeeping (no GPU needed): what is created, mapped, released."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from tidal.worker.lifecycle import cuda_vmm

        self.live: set[int] = set()  # created, not released
        self.mapped: dict[int, int] = {}  # address -> handle
        self.fail_map_at: int | None = None  # fail the map call that would make this many mappings
        self._next = 1
        monkeypatch.setattr(cuda_vmm, "create", self.create)
        monkeypatch.setattr(cuda_vmm, "release", self.live.remove)
        monkeypatch.setattr(cuda_vmm, "map_created", self.map_created)
        monkeypatch.setattr(cuda_vmm, "unmap_and_release", self.unmap_and_release)
        monkeypatch.setattr(cuda_vmm, "make_current", lambda index: None)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def create(self, size: int, device_index: int) -> int:
        self._next += 1
        self.live.add(self._next)
        return self._next

    def map_created(self, base: int, size: int, handle: int, device_index: int) -> None:
        from tidal.worker.lifecycle import cuda_vmm

        if base in self.mapped:
            raise cuda_vmm.CudaDriverError("cuMemMap: already mapped")
        if self.fail_map_at is not None and len(self.mapped) + 1 == self.fail_map_at:
            raise cuda_vmm.CudaDriverError("cuMemMap: out of memory")
        self.mapped[base] = handle

    def unmap_and_release(self, base: int, size: int, handle: int) -> None:
        assert self.mapped.pop(base) == handle
        self.live.remove(handle)


def _released_vmm_region() -> object:
    from tidal.worker.lifecycle.device_memory import VmmRegion

    region = object.__new__(VmmRegion)  # as after a release: reserved, nothing mapped
    region.nbytes, region.device, region.is_resident = 4096, torch.device("cuda", 0), False
    region._index, region._base, region._size = 0, 1 << 40, 4096
    region._pieces = [(region._base + offset, 1024) for offset in range(0, 4096, 1024)]
    region._handles, region._prepared = [], {}
    return region


@pytest.mark.parametrize("prepared_ahead", [False, True])
def test_a_vmm_restore_that_fails_half_way_unmaps_what_it_mapped(monkeypatch, prepared_ahead):
    from tidal.worker.lifecycle import cuda_vmm

    memory = _FakePhysicalMemory(monkeypatch)
    memory.fail_map_at = 3
    region = _released_vmm_region()
    if prepared_ahead:
        region.prepare_restore()
        assert len(memory.live) == 4 and memory.mapped == {}
    with pytest.raises(cuda_vmm.CudaDriverError, match="out of memory"):
        region.restore()
    assert memory.mapped == {} and memory.live == set() and not region.is_resident  # nothing held: wake can retry
    memory.fail_map_at = None
    region.restore()
    assert region.is_resident and len(memory.mapped) == 4 and len(region._handles) == 4
    assert memory.live == set(memory.mapped.values())


def test_memory_prepared_for_a_restore_that_never_comes_is_given_back(monkeypatch):
    memory = _FakePhysicalMemory(monkeypatch)
    region = _released_vmm_region()
    region.prepare_restore()
    region.prepare_restore()  # a second call takes no more
    assert len(memory.live) == 4
    region.release()  # still asleep: drops what was prepared
    assert memory.live == set() and not region.is_resident
    region.prepare_restore()
    region.restore()  # maps the prepared pieces, creates none
    assert len(memory.live) == 4 and set(memory.mapped.values()) == memory.live


def test_a_partial_restore_maps_the_first_pieces_and_the_rest_comes_later(monkeypatch):
    from tidal.worker.lifecycle import cuda_vmm

    memory = _FakePhysicalMemory(monkeypatch)
    region = _released_vmm_region()
    region.restore(num_pieces=1)
    assert region.is_resident and not region.is_complete
    assert sorted(memory.mapped) == [1 << 40]
    memory.fail_map_at = 3  # the rest fails half-way (out of memory): the first piece keeps serving
    with pytest.raises(cuda_vmm.CudaDriverError):
        region.restore_rest()
    assert sorted(memory.mapped) == [1 << 40] and memory.live == set(memory.mapped.values())
    memory.fail_map_at = None
    region.restore_rest()  # a retry maps the rest
    assert region.is_complete and len(memory.mapped) == 4
    region.release()
    assert memory.mapped == {} and memory.live == set() and not region.is_complete


def test_physical_memory_is_given_back_when_mapping_it_fails_half_way(monkeypatch):
    # A fake driver (no GPU needed): the access grant after a successful map fails.
    from tidal.worker.lifecycle import cuda_vmm

    calls: list[str] = []

    class FakeDriver:
        def __getattr__(self, name: str):
            def call(*_args: object) -> int:
                calls.append(name)
                return 1 if name == "cuMemSetAccess" else 0

            return call

    monkeypatch.setattr(cuda_vmm, "_driver", FakeDriver)
    with pytest.raises(cuda_vmm.CudaDriverError, match="cuMemSetAccess"):
        cuda_vmm.create_and_map(1 << 40, 1 << 21, 0)
    assert calls[-2:] == ["cuMemUnmap", "cuMemRelease"]
