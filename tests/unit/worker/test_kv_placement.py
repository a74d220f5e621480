"""Where the KV cache's K/V planes sit in their region and which share a wake maps first (pure arithmetic)."""

import pytest

from tidal.worker.memory.kv_placement import packed_kv, place_kv

MIB = 2**20


def test_planes_start_on_granules_and_the_first_share_holds_whole_blocks():
    # Llama-3-8B-like: 64 planes of 56605 blocks of 32 KiB, 2 MiB granules, 64 MiB first share.
    placement = place_kv(64, 56605, 32 * 1024, 2 * MIB, 64 * MIB)
    stride = placement.plane_offsets[1]
    assert stride % (2 * MIB) == 0 and stride >= placement.plane_bytes
    assert placement.first_blocks == 2048  # 64 MiB / 32 KiB
    assert all(p.size == 64 * MIB for p in placement.first)
    assert [p.offset for p in placement.first] == placement.plane_offsets
    # First and rest together cover each plane's granules exactly once.
    spans: dict[int, list[tuple[int, int]]] = {}
    for p in placement.first + placement.rest:
        plane = p.offset // stride
        spans.setdefault(plane, []).append((p.offset - plane * stride, p.size))
    assert all(sorted(s) == [(0, 64 * MIB), (64 * MIB, stride - 64 * MIB)] for s in spans.values())
    assert placement.total == 64 * stride


def test_a_plane_smaller_than_the_first_share_is_mapped_whole_at_once():
    placement = place_kv(4, 10, 1000, 4096, 64 * MIB)
    assert placement.rest == [] and placement.first_blocks == 10
    assert all(p.size == 12288 for p in placement.first)  # 10000 bytes rounded up to granules


def test_blocks_that_straddle_a_granule_are_not_counted_in_the_first_share():
    placement = place_kv(2, 100, 3000, 4096, 1)  # first share: one granule = 1 whole block of 3000 bytes
    assert placement.first_blocks == 1 and placement.first[0].size == 4096


def test_packed_placement_maps_everything_in_one_piece():
    placement = packed_kv(4, 10, 1000)
    assert placement.first_blocks == 10 and placement.rest == []
    assert placement.plane_offsets == [0, 10240, 20480, 30720] and placement.first[0].size == placement.total


def test_rejects_empty_sizes():
    with pytest.raises(ValueError, match="need positive sizes"):
        place_kv(0, 10, 1000, 4096, MIB)
