"""Kernel tables a sweep just measured, installed in this process, so a step benchmark can run the engine on them
before anyone writes them into the kernels' source. An entry goes into the source only where the decode step gains
from it (a kernel that wins alone can lose inside the step, as the qkv defaults in small_batch_qkv.py record).

The one-row tables (`TUNED_ONE_ROW_CONFIGS` for `linear_rows`, `TUNED_ONE_ROW_QKV_CONFIGS` for the fused qkv), as a
JSON file of [key, [block_n, block_k, num_warps(, weights_first)]] pairs per table; `install` replaces a table's
entries with the file's, so a file with an empty list turns a table off and a table the file does not name keeps the
source's:

    cd benchmarks/kernels && python probe_row_gemv.py --write-table /tmp/one-row.json
    python benchmarks/profile_steps.py --preset qwen3-30b-a3b --batches 1 --one-row-table /tmp/one-row.json

The small-batch MoE tables, from the JSON that sweep_moe_small_batch.py --out writes: `install_moe_sweep` puts each
swept token count's best config (where it beat the grouped GEMMs) into the table of its weight dtype:

    cd benchmarks/kernels && python sweep_moe_small_batch.py --weight-dtype fp8 --tokens 1 --from-tuned --out /tmp/s
    python benchmarks/profile_steps.py ... --moe-sweep /tmp/s/moe-small-batch-sweep-qwen3-30b-a3b-fp8-<gpu>.json
"""

from __future__ import annotations

import json
from pathlib import Path

from tidal.kernels._moe_small_batch_config import (
    TUNED_FP8_SMALL_BATCH_CONFIGS,
    TUNED_SMALL_BATCH_CONFIGS,
    GemvTiles,
    SmallBatchMoeConfig,
)
from tidal.kernels.small_batch_linear import TUNED_ONE_ROW_CONFIGS, OneRowConfig
from tidal.kernels.small_batch_qkv import TUNED_ONE_ROW_QKV_CONFIGS

# The engine's tables, read by the kernels' wrappers at each launch (so a change takes effect before graph capture).
TABLES: dict[str, dict] = {"linear": TUNED_ONE_ROW_CONFIGS, "qkv": TUNED_ONE_ROW_QKV_CONFIGS}
# Key fields per table: linear (outputs, inputs, gated, e4m3 weights); qkv (query heads, KV heads, head_dim,
# inputs, q/k norm, e4m3 weights). The file's keys must match them in length and kind.
KEY_KINDS: dict[str, tuple[type, ...]] = {"linear": (int, int, bool, bool), "qkv": (int, int, int, int, bool, bool)}

Table = dict[tuple, OneRowConfig]


def read(path: Path) -> dict[str, Table]:
    """The tables a file holds; a ValueError names the first malformed entry."""
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict) or not set(raw) <= set(TABLES):
        raise ValueError(f"{path}: expected an object with keys among {sorted(TABLES)}")
    tables: dict[str, Table] = {}
    for name, entries in raw.items():
        table: Table = {}
        for entry in entries:
            key, config = _parse_entry(name, entry)
            table[key] = config
        tables[name] = table
    return tables


def _parse_entry(name: str, entry: object) -> tuple[tuple, OneRowConfig]:
    kinds = KEY_KINDS[name]
    ok = isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list) and isinstance(entry[1], list)
    if ok:
        key, config = entry  # type: ignore[misc]
        ok = (
            len(key) == len(kinds)
            and all(type(value) is kind for value, kind in zip(key, kinds, strict=True))
            and len(config) in (3, 4)
            and all(type(value) is int and value > 0 for value in config[:3])
            and all(type(value) is bool for value in config[3:])
        )
    if not ok:
        raise ValueError(f"{name} entry {entry!r}: expected [[{', '.join(k.__name__ for k in kinds)}], "
                         f"[block_n, block_k, num_warps(, weights_first)]]")  # fmt: skip
    return tuple(key), OneRowConfig(*config)


def _config_fields(config: OneRowConfig) -> list:
    fields = [config.block_n, config.block_k, config.num_warps]
    return [*fields, True] if config.weights_first else fields


def write(path: Path, tables: dict[str, Table]) -> None:
    body = {name: [[list(key), _config_fields(c)] for key, c in table.items()] for name, table in tables.items()}
    path.write_text(json.dumps(body, indent=1) + "\n")


def merge_into(path: Path, name: str, entries: Table, probed: set[tuple]) -> None:
    """Writes `entries` into the file's table `name`, first dropping its entries for the `probed` keys (a shape the
    sweep measured and found no winner for leaves the file without an entry); other tables and keys stay. A new file
    starts from the source's tables, so it holds what the engine would run with once the entries are added."""
    tables = read(path) if path.exists() else {table: dict(entries) for table, entries in TABLES.items()}
    table = {key: config for key, config in tables.get(name, {}).items() if key not in probed}
    table.update(entries)
    tables[name] = table
    write(path, tables)


def install(path: Path) -> dict[str, Table]:
    """Replaces the engine's tables named in the file with the file's entries (in this process); -> what it read."""
    tables = read(path)
    for name, table in tables.items():
        TABLES[name].clear()
        TABLES[name].update(table)
    return tables


def install_moe_sweep(path: Path) -> dict[int, SmallBatchMoeConfig]:
    """Puts a small-batch MoE sweep's winners into the engine's table for its shape and weight dtype (in this
    process), replacing the entries of the token counts it swept; -> {token count: config} installed."""
    sweep = json.loads(path.read_text())
    dims = tuple(sweep["dims"])
    table = TUNED_FP8_SMALL_BATCH_CONFIGS if sweep.get("weight_dtype") == "fp8" else TUNED_SMALL_BATCH_CONFIGS
    won = {}
    for row in sweep["rows"]:
        if row["best_ms"] < row["grouped_ms"]:
            best = row["best"]
            won[row["tokens"]] = SmallBatchMoeConfig(
                GemvTiles(**best["gate_up"]), GemvTiles(**best["down"]),
                **{key: value for key, value in best.items() if key not in ("gate_up", "down")},
            )  # fmt: skip
    entries = {up_to: config for up_to, config in table.get(dims, ()) if up_to not in won}
    table[dims] = tuple(sorted({**entries, **won}.items()))
    return won
