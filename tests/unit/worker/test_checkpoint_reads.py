"""Judging a checkpoint against what a model expects and reading it into given buffers: selection by name, dtype
conversion, strided and typed destinations, a file that shrinks between the check and the read."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tidal.kernels.fp8_linear import quantize_rows_reference
from tidal.kernels.kv_cache_dtype import FP8_E4M3
from tidal.worker.checkpoint import reader
from tidal.worker.checkpoint.directory import stored_tensors
from tidal.worker.checkpoint.errors import CheckpointError, CheckpointUnfitError, ReadTimeoutError
from tidal.worker.checkpoint.fp8_targets import QuantizeInto, fp8_weight_scales, plan_reads
from tidal.worker.checkpoint.header import dtype_name
from tidal.worker.checkpoint.judge import Candidate, Expected, find_problems, tensors_to_read
from tidal.worker.checkpoint.reader import read_into, read_tensors
from tidal.worker.checkpoint.values import FiniteCheck, NonFiniteValuesError, count_non_finite

EXPECTED = {"a": Expected((2, 3), frozenset({"bfloat16"})), "b": Expected((4,), frozenset({"bfloat16", "float32"}))}


def test_find_problems_names_every_kind_of_mismatch():
    ok = {"a": Candidate((2, 3), "bfloat16"), "b": Candidate((4,), "float32")}
    assert find_problems(EXPECTED, ok, allow_extra=False) == []
    bad = {"a": Candidate((3, 2), "float16"), "c": Candidate((1,), "bfloat16"), "inv_freq": Candidate((1,), "x")}
    problems = find_problems(EXPECTED, bad, allow_extra=False, is_ignored=lambda n: n == "inv_freq", extras_hint="hint")
    assert problems == [
        "missing tensors: b",
        "wrong shapes: a: checkpoint [3, 2] vs model [2, 3]",
        "wrong dtypes: a: checkpoint float16 vs model bfloat16",
        "unexpected tensors (the model does not have them; hint): c",
    ]
    assert find_problems(EXPECTED, {**ok, "c": Candidate((1,), "bfloat16")}, allow_extra=True) == []
    many = {f"x{i:02d}": Candidate((1,), "bfloat16") for i in range(10)}
    assert find_problems(EXPECTED, {**ok, **many}, allow_extra=False)[-1].endswith("x06, x07 (and 2 more)")


def test_selection_requires_and_judges_the_wanted_names_only():
    # The other rank's expert is known to the model: absent, or present with any shape, it is neither missing nor
    # extra; an unknown name still is extra.
    expected = {"e0": Expected((2,), frozenset({"float32"})), "e1": Expected((2,), frozenset({"float32"}))}
    assert find_problems(expected, {"e0": Candidate((2,), "float32")}, allow_extra=False, wanted=["e0"]) == []
    candidate = {"e0": Candidate((2,), "float32"), "e1": Candidate((9,), "int8"), "zz": Candidate((1,), "float32")}
    assert find_problems(expected, candidate, allow_extra=False, wanted=["e0"]) == [
        "unexpected tensors (the model does not have them): zz"
    ]
    assert find_problems(expected, {"e0": Candidate((2,), "float32")}, allow_extra=False, wanted=["e1"]) == [
        "missing tensors: e1"
    ]
    with pytest.raises(ValueError, match="wanted tensors the model does not have: nope"):
        find_problems(expected, {}, allow_extra=False, wanted=["nope"])


def checkpoint(directory: Path, tensors: dict[str, torch.Tensor]) -> Path:
    directory.mkdir()
    save_file(tensors, directory / "model.safetensors")
    return directory


def test_a_selection_is_checked_and_read_alone(tmp_path):
    tensors = {f"expert.{i}": torch.full((3, 4), float(i)) for i in range(4)}
    stored = stored_tensors(checkpoint(tmp_path / "c", tensors))
    expected = {n: Expected((3, 4), frozenset({"float32"})) for n in tensors}
    chosen = tensors_to_read(stored, expected, allow_extra=False, wanted={"expert.1", "expert.3"})
    assert sorted(t.name for t in chosen) == ["expert.1", "expert.3"]
    dest = {n: torch.empty(3, 4) for n in ("expert.1", "expert.3")}  # buffers for the selection only
    report = read_tensors(chosen, dest)
    assert report.num_tensors == 2 and report.num_bytes == 2 * 48
    assert torch.equal(dest["expert.1"], tensors["expert.1"]) and torch.equal(dest["expert.3"], tensors["expert.3"])
    with pytest.raises(CheckpointUnfitError, match=r"wrong shapes: expert\.0: checkpoint \[3, 4\] vs model \[4, 3\]"):
        tensors_to_read(stored, {**expected, "expert.0": Expected((4, 3), frozenset({"float32"}))}, allow_extra=False)


def test_reads_convert_the_dtype_and_fill_strided_and_typed_destinations(tmp_path, monkeypatch):
    monkeypatch.setattr(reader, "STAGING_BYTES", 64)  # several fills, big tensors in slices
    monkeypatch.setattr(reader, "STAGING_PIECE_BYTES", 24)
    tensors = {
        "same": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
        "to_f32": torch.randn(5, 3, dtype=torch.float32).to(torch.bfloat16),
        "to_bf16": torch.randn(70),  # 280 bytes: read in slices
        "strided": torch.randn(2, 8),
    }
    stored = stored_tensors(checkpoint(tmp_path / "c", tensors))
    fused = torch.empty(8, 4)  # a destination that is a column slice of a bigger tensor (not contiguous)
    dest = {
        "same": torch.empty(3, 4, dtype=torch.bfloat16),
        "to_f32": torch.empty(5, 3),
        "to_bf16": torch.empty(70, dtype=torch.bfloat16),
        "strided": fused.t()[:2],  # [2, 8]
    }
    report = read_tensors(list(stored.values()), dest)
    assert report.num_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert torch.equal(dest["same"], tensors["same"])
    assert torch.equal(dest["to_f32"], tensors["to_f32"].float())
    assert torch.equal(dest["to_bf16"], tensors["to_bf16"].to(torch.bfloat16))
    assert torch.equal(fused.t()[:2], tensors["strided"])
    with pytest.raises(ValueError, match="destination shape"):
        read_tensors([stored["same"]], {"same": torch.empty(4, 3, dtype=torch.bfloat16)})


def test_big_tensors_are_read_in_pieces_on_several_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(reader, "PIECE_BYTES", 40)
    tensors = {"w": torch.randn(1000), "b": torch.randn(3)}
    stored = stored_tensors(checkpoint(tmp_path / "c", tensors))
    dest = {n: torch.empty_like(t) for n, t in tensors.items()}
    assert read_into([(stored[n], dest[n]) for n in dest], num_threads=4) == 4012
    assert all(torch.equal(dest[n], tensors[n]) for n in tensors)


def test_a_file_that_shrinks_after_its_check_is_a_problem_when_read(tmp_path):
    directory = checkpoint(tmp_path / "c", {"w": torch.randn(64)})
    stored = stored_tensors(directory)
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="reading the checkpoint failed part way: unexpected end of file"):
        read_tensors(list(stored.values()), {"w": torch.empty(64)})


def test_staged_parts_of_mixed_dtypes_sit_at_aligned_offsets(tmp_path):
    # A bf16 tensor of an odd length ends 2 bytes past a 4-byte boundary; the f32 tensor staged after it in the same
    # buffer must still start where a float32 view of the buffer can begin.
    tensors = {"a": torch.randn(3).to(torch.bfloat16), "b": torch.randn(5), "c": torch.randn(7).to(torch.float16)}
    stored = stored_tensors(checkpoint(tmp_path / "c", tensors))
    dest = {"a": torch.empty(3), "b": torch.empty(5, dtype=torch.float64), "c": torch.empty(7)}  # all converted
    read_tensors([stored[n] for n in ("a", "b", "c")], dest)
    assert all(torch.equal(dest[n], tensors[n].to(dest[n].dtype)) for n in tensors)


def test_a_read_blocked_past_the_deadline_fails_it_and_is_left_to_settle(tmp_path, monkeypatch):
    tensors = {"w": torch.randn(64), "h": torch.randn(8).half()}  # one read directly, one through staging
    stored = stored_tensors(checkpoint(tmp_path / "c", tensors))
    unblock = threading.Event()
    real_read = reader._read_fully

    def stalled(fd: int, offset: int, buf: memoryview) -> int:
        unblock.wait()  # as a read of a stalled network file system: not interruptible
        return real_read(fd, offset, buf)

    monkeypatch.setattr(reader, "_read_fully", stalled)
    dest = {"w": torch.empty(64), "h": torch.empty(8)}
    start = time.monotonic()
    with pytest.raises(ReadTimeoutError, match="did not finish in time") as err:
        read_tensors(list(stored.values()), dest, deadline=time.monotonic() + 0.2)
    assert time.monotonic() - start < 5 and not err.value.settled.is_set()
    unblock.set()  # the read returns at last: its thread ends and its file is closed
    assert err.value.settled.wait(5)


def test_quantizing_reads_take_whole_rows_and_plan_the_scales(tmp_path, monkeypatch):
    """An FP8 destination receives a float tensor a few rows per fill (never a row cut in two), quantized as the
    reference quantizes; a checkpoint that stores the e4m3 weight and its scale is read as it is."""
    monkeypatch.setattr(reader, "STAGING_BYTES", 5 * 24 * 2)  # five bf16 rows of 24 per fill
    weight = (torch.randn(17, 24) * torch.linspace(0.1, 10, 17)[:, None]).to(torch.bfloat16)
    stored = stored_tensors(checkpoint(tmp_path / "f", {"p.weight": weight, "n.weight": torch.ones(3)}))
    served = {
        "p.weight": torch.zeros(17, 24, dtype=FP8_E4M3),
        "p.weight_scale": torch.zeros(17),
        "n.weight": torch.zeros(3),
    }
    expected = {name: Expected(tuple(t.shape), frozenset({dtype_name(t.dtype)})) for name, t in served.items()}
    assert fp8_weight_scales(served) == {"p.weight": "p.weight_scale"}
    planned, destinations = plan_reads(expected, served, stored)
    assert planned.keys() == {"p.weight", "n.weight"} and "bfloat16" in planned["p.weight"].dtypes
    assert isinstance(destinations["p.weight"], QuantizeInto) and "p.weight_scale" not in destinations
    read_tensors(tensors_to_read(stored, planned, allow_extra=False), destinations)
    q, scale = quantize_rows_reference(weight)
    assert torch.equal(served["p.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(served["p.weight_scale"], scale) and torch.equal(served["n.weight"], torch.ones(3))
    # The served tensors written as a checkpoint: e4m3 and the scale, read byte for byte.
    again = stored_tensors(checkpoint(tmp_path / "q", {n: t.clone() for n, t in served.items()}))
    copies = {n: torch.empty_like(t) for n, t in served.items()}
    planned, destinations = plan_reads(expected, copies, again)
    assert planned == expected and all(isinstance(d, torch.Tensor) for d in destinations.values())
    read_tensors(tensors_to_read(again, planned, allow_extra=False), destinations)
    assert all(torch.equal(copies[n].view(torch.uint8), t.view(torch.uint8)) for n, t in served.items())


def test_non_finite_values_fail_the_read_naming_each_tensor(tmp_path, monkeypatch):
    """Direct, staged (converted, in parts) and quantizing reads all count NaN and Inf; an integer tensor has none;
    a value a conversion pushes past the destination's range is reported as such."""
    monkeypatch.setattr(reader, "STAGING_BYTES", 4 * 24 * 4)  # parts of four fp32 rows of 24
    direct = torch.ones(5, 3)
    direct[1, 2] = float("nan")
    converted = torch.randn(17, 24)
    converted[0, 0], converted[16, 23] = float("inf"), -float("inf")  # in the first and the last part
    quantized = torch.randn(9, 24)
    quantized[4] = float("nan")  # a whole row: its scale would be NaN, hiding how many
    overflow = torch.tensor([1.0, 70000.0])  # beyond float16's range
    tensors = {"direct": direct, "converted": converted, "quantized": quantized, "overflow": overflow,
               "ints": torch.arange(4), "fine": torch.randn(3)}  # fmt: skip
    stored = stored_tensors(checkpoint(tmp_path / "c", tensors))
    destinations = {
        "direct": torch.empty(5, 3),
        "converted": torch.empty(17, 24, dtype=torch.bfloat16),
        "quantized": QuantizeInto(torch.zeros(9, 24, dtype=FP8_E4M3), torch.zeros(9)),
        "overflow": torch.empty(2, dtype=torch.float16),
        "ints": torch.empty(4, dtype=torch.int64),
        "fine": torch.empty(3),
    }
    with pytest.raises(NonFiniteValuesError) as err:
        read_tensors(list(stored.values()), destinations)
    assert sorted(err.value.problems) == [
        "converted: 2 non-finite values (NaN or Inf)",
        "direct: 1 non-finite value (NaN or Inf)",
        "overflow: 1 non-finite value (NaN or Inf, or beyond float16's range)",
        "quantized: 24 non-finite values (NaN or Inf)",
    ]
    assert isinstance(err.value, CheckpointError)  # every caller's existing handling of a bad checkpoint applies


def test_the_finite_check_reads_float8_values_and_counts_exactly():
    e4m3 = torch.tensor([1.0, float("nan"), -2.0, float("nan")]).to(FP8_E4M3)
    assert count_non_finite(e4m3) == 2 and count_non_finite(torch.tensor([1, 2])) == 0
    check = FiniteCheck()
    check.add("w", e4m3)
    check.add("w", torch.tensor([float("inf")]))  # another part of the same tensor
    check.add("ok", torch.ones(2, dtype=torch.bfloat16))
    check.add("empty", torch.empty(0))
    assert check.problems() == ["w: 3 non-finite values (NaN or Inf)"]
