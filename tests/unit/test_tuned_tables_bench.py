"""benchmarks/perf/tuned_tables.py: kernel tables a sweep just measured, installed so profile_steps.py can run the
engine on them: the one-row tables (probe_row_gemv.py) and the small-batch MoE tables (sweep_moe_small_batch.py)."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from perf import tuned_tables  # noqa: E402

from tidal.kernels._moe_small_batch_config import (  # noqa: E402
    TUNED_FP8_SMALL_BATCH_CONFIGS,
    TUNED_SMALL_BATCH_CONFIGS,
    GemvTiles,
    SmallBatchMoeConfig,
    small_batch_moe_config,
)
from tidal.kernels.small_batch_linear import TUNED_ONE_ROW_CONFIGS, OneRowConfig, choose_one_row_config  # noqa: E402
from tidal.kernels.small_batch_qkv import choose_one_row_qkv_config  # noqa: E402

QKV_KEY = (32, 4, 128, 2048, True, True)


def test_a_new_file_starts_from_the_source_tables(tmp_path):
    path = tmp_path / "one-row.json"
    qkv_key = (8, 8, 64, 512, False, False)  # a shape the source has no entry for
    tuned_tables.merge_into(path, "qkv", {qkv_key: OneRowConfig(4, 512, 4)}, {qkv_key})
    tables = tuned_tables.read(path)
    assert tables["linear"] == TUNED_ONE_ROW_CONFIGS  # installing it changes only what the probe found
    assert tables["qkv"] == {**tuned_tables.TABLES["qkv"], qkv_key: OneRowConfig(4, 512, 4)}


def test_merge_keeps_other_shapes_and_drops_probed_losers(tmp_path):
    path = tmp_path / "one-row.json"
    tuned_tables.write(path, {})
    tuned_tables.merge_into(path, "linear", {(2048, 4096, False, True): OneRowConfig(8, 2048, 8)}, set())
    tuned_tables.merge_into(path, "linear", {(128, 2048, False, False): OneRowConfig(2, 2048, 8)},
                              {(128, 2048, False, False)})  # fmt: skip
    tuned_tables.merge_into(path, "qkv", {QKV_KEY: OneRowConfig(4, 1024, 4)}, {QKV_KEY})
    o_proj, router = (2048, 4096, False, True), (128, 2048, False, False)
    assert tuned_tables.read(path) == {
        "linear": {o_proj: OneRowConfig(8, 2048, 8), router: OneRowConfig(2, 2048, 8)},
        "qkv": {QKV_KEY: OneRowConfig(4, 1024, 4)},
    }
    # A later sweep that finds no winner for a probed shape removes its entry; the other shapes stay.
    tuned_tables.merge_into(path, "linear", {}, {(2048, 4096, False, True)})
    assert tuned_tables.read(path)["linear"] == {(128, 2048, False, False): OneRowConfig(2, 2048, 8)}


def test_a_weights_first_entry_round_trips_and_plain_ones_keep_three_fields(tmp_path):
    path = tmp_path / "one-row.json"
    o_proj, router = (2048, 4096, False, True), (128, 2048, False, False)
    tables = {"linear": {o_proj: OneRowConfig(8, 2048, 8, weights_first=True), router: OneRowConfig(2, 2048, 8)}}
    tuned_tables.write(path, tables)
    assert json.loads(path.read_text())["linear"] == [[list(o_proj), [8, 2048, 8, True]], [list(router), [2, 2048, 8]]]
    assert tuned_tables.read(path) == tables


def test_install_replaces_only_the_tables_the_file_names(tmp_path):
    saved = dict(TUNED_ONE_ROW_CONFIGS)
    path = tmp_path / "one-row.json"
    tuned_tables.write(path, {"qkv": {QKV_KEY: OneRowConfig(4, 1024, 4)}})
    try:
        tuned_tables.install(path)
        assert choose_one_row_qkv_config(*QKV_KEY) == OneRowConfig(4, 1024, 4)
        assert saved == TUNED_ONE_ROW_CONFIGS  # the file names no linear table: the source's entries stay
        tuned_tables.write(path, {"linear": {}, "qkv": {}})
        tuned_tables.install(path)
        assert choose_one_row_qkv_config(*QKV_KEY) is None
        assert choose_one_row_config(2048, 4096, False, True) is None  # an empty list turns the table off
    finally:
        tuned_tables.TABLES["linear"].update(saved)
        tuned_tables.TABLES["qkv"].clear()
    assert saved == TUNED_ONE_ROW_CONFIGS


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"conv": []}', "keys among"),
        ('{"linear": [[[2048, 4096, false], [8, 2048, 8]]]}', r"linear entry .*\[\[int, int, bool, bool\]"),
        ('{"linear": [[[2048, 4096, 0, 1], [8, 2048, 8]]]}', "linear entry"),  # 0/1 are not bools
        ('{"qkv": [[[32, 4, 128, 2048, true, true], [4, 1024]]]}', "block_n, block_k, num_warps"),
        ('{"qkv": [[[32, 4, 128, 2048, true, true], [4, 0, 4]]]}', "qkv entry"),
        ('{"qkv": [[[32, 4, 128, 2048, true, true], [4, 1024, 4, 1]]]}', r"num_warps\(, weights_first\)"),
    ],
)
def test_a_malformed_file_names_its_entry(tmp_path, body, message):
    path = tmp_path / "one-row.json"
    path.write_text(body)
    with pytest.raises(ValueError, match=message):
        tuned_tables.read(path)


def test_a_moe_sweep_replaces_only_the_counts_it_won(tmp_path, monkeypatch):
    dims = (128, 8, 2048, 768)
    monkeypatch.setitem(TUNED_FP8_SMALL_BATCH_CONFIGS, dims, TUNED_FP8_SMALL_BATCH_CONFIGS[dims])
    monkeypatch.setitem(TUNED_SMALL_BATCH_CONFIGS, dims, TUNED_SMALL_BATCH_CONFIGS[dims])
    bf16_before = TUNED_SMALL_BATCH_CONFIGS[dims]
    row_gemv = SmallBatchMoeConfig(GemvTiles(2, 2048, 8, 3), GemvTiles(4, 1024, 4), down_splits=8)
    grouped_wins = SmallBatchMoeConfig(GemvTiles(1, 1024, 4), GemvTiles(1, 256, 4))
    rows = [
        {"tokens": 1, "best": dataclasses.asdict(row_gemv), "best_ms": 0.020, "grouped_ms": 0.043},
        {"tokens": 2, "best": dataclasses.asdict(grouped_wins), "best_ms": 0.050, "grouped_ms": 0.040},
    ]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"shape": "qwen3-30b-a3b", "dims": dims, "weight_dtype": "fp8", "rows": rows}))
    assert tuned_tables.install_moe_sweep(path) == {1: row_gemv}
    assert small_batch_moe_config(1, 8, 128, 2048, 768, fp8_experts=True) == row_gemv
    assert small_batch_moe_config(2, 8, 128, 2048, 768, fp8_experts=True) == bf16_before[1][1]  # unchanged
    assert TUNED_SMALL_BATCH_CONFIGS[dims] == bf16_before  # an fp8 sweep leaves the 16-bit table
