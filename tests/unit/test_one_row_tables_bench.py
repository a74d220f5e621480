"""benchmarks/perf/one_row_tables.py: the one-row tables as a file, so profile_steps.py can run the engine on the
entries probe_row_gemv.py just found."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from perf import one_row_tables  # noqa: E402

from tidal.kernels.small_batch_linear import TUNED_ONE_ROW_CONFIGS, OneRowConfig, choose_one_row_config  # noqa: E402
from tidal.kernels.small_batch_qkv import choose_one_row_qkv_config  # noqa: E402

QKV_KEY = (32, 4, 128, 2048, True, True)


def test_merge_keeps_other_shapes_and_drops_probed_losers(tmp_path):
    path = tmp_path / "one-row.json"
    one_row_tables.merge_into(path, "linear", {(2048, 4096, False, True): OneRowConfig(8, 2048, 8)}, set())
    one_row_tables.merge_into(path, "linear", {(128, 2048, False, False): OneRowConfig(2, 2048, 8)},
                              {(128, 2048, False, False)})  # fmt: skip
    one_row_tables.merge_into(path, "qkv", {QKV_KEY: OneRowConfig(4, 1024, 4)}, {QKV_KEY})
    o_proj, router = (2048, 4096, False, True), (128, 2048, False, False)
    assert one_row_tables.read(path) == {
        "linear": {o_proj: OneRowConfig(8, 2048, 8), router: OneRowConfig(2, 2048, 8)},
        "qkv": {QKV_KEY: OneRowConfig(4, 1024, 4)},
    }
    # A later sweep that finds no winner for a probed shape removes its entry; the other shapes stay.
    one_row_tables.merge_into(path, "linear", {}, {(2048, 4096, False, True)})
    assert one_row_tables.read(path)["linear"] == {(128, 2048, False, False): OneRowConfig(2, 2048, 8)}


def test_install_replaces_only_the_tables_the_file_names(tmp_path):
    saved = dict(TUNED_ONE_ROW_CONFIGS)
    path = tmp_path / "one-row.json"
    one_row_tables.write(path, {"qkv": {QKV_KEY: OneRowConfig(4, 1024, 4)}})
    try:
        one_row_tables.install(path)
        assert choose_one_row_qkv_config(*QKV_KEY) == OneRowConfig(4, 1024, 4)
        assert saved == TUNED_ONE_ROW_CONFIGS  # the file names no linear table: the source's entries stay
        one_row_tables.write(path, {"linear": {}, "qkv": {}})
        one_row_tables.install(path)
        assert choose_one_row_qkv_config(*QKV_KEY) is None
        assert choose_one_row_config(2048, 4096, False, True) is None  # an empty list turns the table off
    finally:
        one_row_tables.TABLES["linear"].update(saved)
        one_row_tables.TABLES["qkv"].clear()
    assert saved == TUNED_ONE_ROW_CONFIGS


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"conv": []}', "keys among"),
        ('{"linear": [[[2048, 4096, false], [8, 2048, 8]]]}', r"linear entry .*\[\[int, int, bool, bool\]"),
        ('{"linear": [[[2048, 4096, 0, 1], [8, 2048, 8]]]}', "linear entry"),  # 0/1 are not bools
        ('{"qkv": [[[32, 4, 128, 2048, true, true], [4, 1024]]]}', "block_n, block_k, num_warps"),
        ('{"qkv": [[[32, 4, 128, 2048, true, true], [4, 0, 4]]]}', "qkv entry"),
    ],
)
def test_a_malformed_file_names_its_entry(tmp_path, body, message):
    path = tmp_path / "one-row.json"
    path.write_text(body)
    with pytest.raises(ValueError, match=message):
        one_row_tables.read(path)
