"""bench/bench_lengths.py at tiny sizes, 1 rank, in this process: the table's invariants, not its timings. Packing
and the padding-free floor see no padding, the token budget less than fixed micro-batches of the same rows, every
mode trains the same tokens, one rank is its own mean, and the FLOP/s ratio is a positive fraction. About 1 s
(8 train steps of a 0.1 M-parameter model), plus the transformers import when nothing imported it before."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_lengths  # noqa: E402


def test_the_bench_table_at_tiny_sizes() -> None:
    a = bench_lengths.parse(["--rows", "8", "--median", "12", "--cap", "48", "--prompt", "4", "--micro", "2",
                             "--tokens", "64", "--steps", "1", "--size", "tiny", "--matmul-s", "0.01"])
    rows = {r["mode"]: r for r in bench_lengths.run(a, [1], in_process=True)}
    assert set(rows) == set(bench_lengths.MODES)
    assert len({r["tokens"] for r in rows.values()}) == 1  # the floor: the same tokens in equal rows
    assert rows["packed"]["padded_frac"] == 0.0 and rows["floor"]["padded_frac"] == 0.0
    assert rows["packed"]["forward_tokens"] == rows["packed"]["tokens"]
    assert 0.0 < rows["budget"]["padded_frac"] < rows["fixed"]["padded_frac"]  # the long tail pads fixed ones most
    assert rows["packed"]["micro_batches"] <= rows["budget"]["micro_batches"]
    assert rows["floor"]["over_floor"] == 1.0
    for r in rows.values():
        assert r["slow_over_mean"] == 1.0 and r["ranks"] == 1
        assert r["tok_s"] > 0 and 0.0 < r["flop_ratio"] < 2.0, r  # < 1 in principle; timer noise at tiny sizes
    text = bench_lengths.table(list(rows.values()))
    assert "padded %" in text and len(text.splitlines()) == 2 + len(rows)
