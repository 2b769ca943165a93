"""The check before compiling serving programs on CPU (jaxpar.serving.code_maps): past
vm.max_map_count XLA segfaults, so the estimate refuses first, in one line with the
numbers. Nothing here compiles."""

import sys

import pytest

from jaxpar.serving import code_maps
from jaxpar.serving.code_maps import (HEADROOM, MAPS_PER_PROGRAM, MAPS_PER_SPECULATIVE_PROGRAM, check_code_mappings,
                                      current_mappings, estimate_error, map_limit, suggested_limit)


def test_constants():
    assert MAPS_PER_PROGRAM == 360 and MAPS_PER_SPECULATIVE_PROGRAM == 1050 and HEADROOM == 0.9


def test_fits():
    # 1,000 + 100 * 360 = 37,000 <= 0.9 * 65,530 = 58,977
    assert estimate_error(1_000, 100, 65_530) is None
    assert estimate_error(1_000, 0, 100) is None  # nothing to compile: nothing to refuse
    # exactly at 90%: 36 + 164 * 360 = 59,076 = int(0.9 * 65,641) allowed
    assert int(65_641 * 0.9) == 59_076 and estimate_error(36, 164, 65_641) is None


def test_one_past_headroom():
    assert estimate_error(37, 164, 65_641) is not None  # 59,077 > 59,076


def test_refuses_with_the_numbers():
    # 276 programs (the bucketed engine's 138 at --max-context 2048, in two replicas).
    # 900 + 276 * 360 = 100,260 > 58,977; suggested 2 * 100,260 = 200,520 -> 262,144
    error = estimate_error(900, 276, 65_530)
    assert "\n" not in error
    for part in ("276 programs", "100,260", "900 now", "~360", "vm.max_map_count=65,530", "58,977", "90%",
                 "--max-num-batched-tokens", "replicas",
                 "sysctl -w vm.max_map_count=262144"):
        assert part in error, part


def test_speculative_programs():
    # 105 programs of a draft's size (the bucketed engine's, SmolLM2 with a draft at 2048).
    # 1,000 + 105 * 360 = 38,800 fits; 1,000 + 105 * 1,050 = 111,250 > 58,977 -> 262,144
    assert estimate_error(1_000, 105, 65_530) is None
    error = estimate_error(1_000, 105, 65_530, MAPS_PER_SPECULATIVE_PROGRAM)
    for part in ("105 programs", "111,250", "1,000 now", "~1050", "sysctl -w vm.max_map_count=262144"):
        assert part in error, part


def test_suggested_limit():
    assert suggested_limit(83_700) == 196_608
    assert suggested_limit(30_000) == 65_536
    assert suggested_limit(32_768) == 65_536 and suggested_limit(32_769) == 131_072
    assert suggested_limit(0) == 65_536


def test_check_raises_on_cpu(monkeypatch):
    monkeypatch.setattr(code_maps, "current_mappings", lambda: 900)
    monkeypatch.setattr(code_maps, "map_limit", lambda: 65_530)
    with pytest.raises(ValueError, match=r"276 programs .*100,260 .*vm.max_map_count=65,530"):
        check_code_mappings(276, platform="cpu")
    assert check_code_mappings(100, platform="cpu") is None  # 36,900
    with pytest.raises(ValueError, match=r"100 programs .*105,900 "):  # 900 + 100 * 1,050
        check_code_mappings(100, platform="cpu", maps_per_program=MAPS_PER_SPECULATIVE_PROGRAM)


@pytest.mark.parametrize("platform", ["gpu", "cuda", "rocm", "tpu"])
def test_other_platforms_never_raise(monkeypatch, platform):
    monkeypatch.setattr(code_maps, "current_mappings", lambda: 900)
    monkeypatch.setattr(code_maps, "map_limit", lambda: 65_530)
    assert check_code_mappings(10**6, platform=platform) is None
    assert check_code_mappings(10**6, platform=platform, maps_per_program=MAPS_PER_SPECULATIVE_PROGRAM) is None


@pytest.mark.parametrize("current, limit", [(None, 65_530), (900, None), (None, None)])
def test_unreadable_counts_skip_the_check(monkeypatch, current, limit):
    monkeypatch.setattr(code_maps, "current_mappings", lambda: current)
    monkeypatch.setattr(code_maps, "map_limit", lambda: limit)
    assert check_code_mappings(10**6, platform="cpu") is None


def test_missing_proc(monkeypatch, tmp_path):
    monkeypatch.setattr(code_maps, "MAPS", str(tmp_path / "maps"))
    monkeypatch.setattr(code_maps, "MAX_MAP_COUNT", str(tmp_path / "max_map_count"))
    assert current_mappings() is None and map_limit() is None
    (tmp_path / "max_map_count").write_text("not a number\n")
    assert map_limit() is None
    (tmp_path / "max_map_count").write_text("262144\n")
    assert map_limit() == 262_144


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_this_process():
    current, limit = current_mappings(), map_limit()
    assert isinstance(current, int) and current > 0
    assert isinstance(limit, int) and limit > 0
