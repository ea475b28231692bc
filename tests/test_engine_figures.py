"""The engine benchmarks' regression report (benchmarks/engines.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.engines import Figures, compare


def _figures(
    tmp: Path, engine: str, rows: dict[str, tuple[list[float], list[float]]]
) -> dict[str, Any]:
    f = Figures(engine)
    for name, (kvtier, ceiling) in rows.items():
        f.add(name, kvtier, ceiling)
    path = tmp / f"{engine}.json"
    f.write(path)
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def test_a_row_that_fell_past_its_noise_is_named_and_one_within_it_is_not(tmp_path: Path) -> None:
    # ratios: the ceiling's seconds over kvtier's, run by run
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    before = _figures(
        tmp_path / "a",
        "vllm",
        {
            "loads 1MiB / memcpy": ([1.0, 1.0, 1.0], [0.9, 0.9, 0.9]),  # 0.90x, no spread
            "stores 1MiB / memcpy": ([1.0, 1.0, 1.0], [0.6, 0.8, 0.7]),  # 0.70x, ±14%
        },
    )
    after = _figures(
        tmp_path / "b",
        "vllm",
        {
            "loads 1MiB / memcpy": ([1.0, 1.0, 1.0], [0.7, 0.7, 0.7]),  # fell by 22%
            "stores 1MiB / memcpy": ([1.0, 1.0, 1.0], [0.62, 0.62, 0.62]),  # -11%: noise
            "loads 2MiB / memcpy": ([1.0], [0.95]),
        },
    )
    report = compare(after, before)
    fell = [line for line in report if "FELL" in line]
    assert len(fell) == 1 and "loads 1MiB / memcpy" in fell[0]
    assert any("(new row)" in line and "loads 2MiB" in line for line in report)
    assert report[-1] == "1 row(s) fell by more than the noise"
    assert compare(before, before)[-1] == "no row fell"


def test_figures_of_several_engines_share_one_file(tmp_path: Path) -> None:
    path = tmp_path / "engines.json"
    for engine in ("vllm", "lmcache"):
        f = Figures(engine)
        assert f.add("get 256 KiB / memcpy", [2.0, 2.0, 4.0], [1.0, 1.0, 1.0]) == 0.5
        f.write(path)
    data = json.loads(path.read_text())
    assert set(data) == {"vllm", "lmcache"}
    assert data["lmcache"]["rows"]["get 256 KiB / memcpy"]["runs"] == [0.5, 0.5, 0.25]
