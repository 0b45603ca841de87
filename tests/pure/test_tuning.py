"""auto's choice (ringcoll/tuning.py): the band lines, the margin, where the fastest changes,
and the table's file: written by the benchmark, read by every rank alike."""

import json
import math
import os

import pytest

from ringcoll import plans, tuning
from ringcoll._types import RING_COLLECTIVES


def test_bands_follow_the_band_lines_and_the_margin():
    # Band [1000, 2000]: native 0.01 n; rd 1.05 (20 - 0.005 (n - 1000)) = 26.25 - 0.00525 n,
    # equal at n = 26.25 / 0.01525 = 1721.3. Band [2000, 4000]: rd 1.05 (15 + 0.0175 (n - 2000))
    # = 0.018375 n - 21, equal to native at 21 / 0.008375 = 2507.5.
    times = {"native": {1000: 10.0, 2000: 20.0, 4000: 40.0}, "rd": {1000: 20.0, 2000: 15.0, 4000: 50.0}}
    bands = tuning.lower_envelope(times)
    assert bands == [(0, "native"), (1722, "rd"), (2508, "native")]
    assert [tuning.choose(bands, n) for n in (0, 1721, 1722, 2507, 2508, 10**9)] == \
        ["native", "native", "rd", "rd", "native", "native"]


def test_past_the_last_size_the_last_choice_holds():
    # Extended, the last band's lines would cross at 3588 bytes (native 0.02 n - 10 against rd's
    # 1.05 (0.015 n + 5)); past 2000 each time grows in proportion to the bytes instead.
    times = {"native": {1000: 10.0, 2000: 30.0}, "rd": {1000: 20.0, 2000: 35.0}}
    assert tuning.lower_envelope(times) == [(0, "native")]


def test_a_plan_needs_the_margin_and_ties_go_to_native():
    within = {"native": {1000: 10.0, 2000: 20.0}, "rd": {1000: 9.6, 2000: 19.2}}  # 4% faster: not enough
    assert tuning.lower_envelope(within) == [(0, "native")]
    clear = {"native": {1000: 10.0, 2000: 20.0}, "rd": {1000: 9.0, 2000: 18.0}}  # 10% faster, at every size
    assert tuning.lower_envelope(clear) == [(0, "rd")]
    assert tuning.lower_envelope({"native": {1000: 5.0}, "ring": {1000: 5.0}}) == [(0, "native")]


def test_a_band_narrower_than_an_eighth_of_its_start_goes_to_the_band_before():
    bands = [(0, "native"), (4079, "rd"), (4143, "native"), (124058, "oneshot"), (997273, "native"),
             (1091128, "oneshot"), (2409990, "native")]
    # 4079..4143 and 997273..1091128 are slivers (under 1/8 of where they start); the last band never is
    assert tuning.without_slivers(bands) == [(0, "native"), (124058, "oneshot"), (2409990, "native")]
    assert tuning.without_slivers([(0, "rd"), (10, "native")]) == [(0, "rd"), (10, "native")]  # 10..inf
    table = tuning.load(str(tuning.DEFAULT_TABLE))  # the shipped table's bands have none
    for world, by_collective in table.times_us.items():
        for collective in by_collective:
            bands = table.bands(collective, world)
            ends = [start for start, _ in bands[1:]] + [math.inf]
            assert all(end - start >= tuning.MIN_BAND * start for (start, _), end in zip(bands, ends)), bands


def test_below_the_first_size_its_times_decide_and_only_common_sizes_count():
    times = {"native": {4096: 10.0, 8192: 12.0}, "oneshot": {1024: 1.0, 4096: 5.0, 8192: 30.0}}
    # 1024 was not timed for native: the bands start from 4096's times (oneshot cheaper there).
    bands = tuning.lower_envelope(times)
    assert bands[0] == (0, "oneshot") and tuning.choose(bands, 1) == "oneshot"
    assert tuning.choose(bands, 8192) == "native"
    assert tuning.lower_envelope({}) == [(0, "native")]


def test_a_table_is_written_world_by_world_and_read_back(tmp_path):
    path = tmp_path / "tuning.json"
    two = {"all_reduce": {"native": {1024: 3.0, 4096: 9.0}, "rd": {1024: 2.0, 4096: 20.0}}}
    four = {"all_reduce": {"native": {1024: 30.0}, "rhd": {1024: 10.0}}}
    first = tuning.record(str(path), 2, two, "machine A")
    table = tuning.record(str(path), 4, four, "machine B")
    assert table.times_us == {2: two, 4: four} and table.recorded == {2: "machine A", 4: "machine B"}
    assert table.bands("all_reduce", 4) == [(0, "rhd")]
    assert table.bands("all_gather", 2) == table.bands("all_reduce", 3) == [(0, "native")]  # not in the table
    assert tuning.load(str(path)).digest == table.digest != first.digest
    again = tuning.record(str(path), 2, two, "machine C")  # the same times again: the same table
    assert again.digest == table.digest and again.recorded[2] == "machine A; then machine C"
    # A refinement replaces the times it measured and keeps the others.
    refined = tuning.record(str(path), 2, {"all_reduce": {"rd": {4096: 5.0}}}, "a longer run")
    assert refined.times_us[2]["all_reduce"] == {"native": {1024: 3.0, 4096: 9.0}, "rd": {1024: 2.0, 4096: 5.0}}
    assert refined.times_us[4] == four and refined.bands("all_reduce", 2) == [(0, "rd")]


def test_a_table_holds_for_the_machine_it_was_recorded_on(tmp_path, monkeypatch):
    """tuning.this_machine names the CPU and the cores; a table records it, holds there only,
    and never mixes two machines' times; one with no machine (older) holds anywhere."""
    assert tuning.this_machine().endswith(f" x {os.cpu_count()} cores")
    path = str(tmp_path / "t.json")
    times = {"all_reduce": {"native": {1024: 3.0}, "rd": {1024: 1.0}}}
    table = tuning.record(path, 2, times, "a run", machine="CPU A x 2 cores")
    assert table.machine == tuning.load(path).machine == "CPU A x 2 cores"
    monkeypatch.setattr(tuning, "this_machine", lambda: "CPU A x 2 cores")
    assert table.holds_here()
    monkeypatch.setattr(tuning, "this_machine", lambda: "CPU B x 8 cores")
    assert not table.holds_here()
    with pytest.raises(ValueError, match=r"was recorded on CPU A x 2 cores; this is CPU B x 8 cores: record into a "
                                         r"fresh file"):
        tuning.record(path, 4, times, "another run")
    assert tuning.load(path).times_us == {2: times}  # untouched
    legacy = tmp_path / "legacy.json"
    legacy.write_text(json.dumps({"times_us": {"2": {"all_reduce": {"native": {"1024": 3.0}}}}}))
    assert tuning.load(str(legacy)).machine == "" and tuning.load(str(legacy)).holds_here()


def test_a_table_without_native_or_unreadable_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needs .native. times for all_reduce"):
        tuning.record(str(tmp_path / "t.json"), 2, {"all_reduce": {"rd": {1024: 1.0}}}, "")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"times_us": {"two": {}}}))
    with pytest.raises(ValueError, match=r"RINGCOLL_TUNING: cannot read a tuning table from .*bad\.json"):
        tuning.load(str(bad))
    with pytest.raises(ValueError, match="RINGCOLL_TUNING: cannot read a tuning table"):
        tuning.load(str(tmp_path / "absent.json"))
    # Only what auto weighs: a registered plan need not exist where the table is read.
    for collective, name in (("all_reduce", "bidir"), ("reduce_scatter", "rd")):
        stranger = tmp_path / f"{name}.json"
        stranger.write_text(json.dumps({"times_us": {"2": {collective: {"native": {"1": 1}, name: {"1": 1}}}}}))
        with pytest.raises(ValueError, match=f"prices {name} for {collective} at P = 2: auto weighs only native, "
                                             "ring, oneshot, rhd"):
            tuning.load(str(stranger))


def test_an_in_place_call_chooses_by_the_in_place_times_where_the_table_has_them(tmp_path):
    """"<collective> in place" holds a collective's in-place times (DDP's form): bands(in_place=True)
    reads them, and the out-of-place ones where the table has none; a key that is neither a
    collective nor one in place is refused by name."""
    times = {"all_reduce": {"native": {1024: 3.0}, "rd": {1024: 1.0}},
             "all_reduce in place": {"native": {1024: 1.0}, "rd": {1024: 3.0}},
             "reduce_scatter": {"native": {1024: 3.0}, "rhd": {1024: 1.0}}}
    table = tuning.record(str(tmp_path / "t.json"), 2, times, "both forms")
    assert table.bands("all_reduce", 2) == [(0, "rd")] and table.bands("all_reduce", 2, in_place=True) == [(0, "native")]
    assert table.bands("reduce_scatter", 2, in_place=True) == table.bands("reduce_scatter", 2) == [(0, "rhd")]
    sideways = tmp_path / "sideways.json"
    sideways.write_text(json.dumps({"times_us": {"2": {"all_reduce sideways": {"native": {"1": 1}}}}}))
    with pytest.raises(ValueError, match="names 'all_reduce sideways', not a collective"):
        tuning.load(str(sideways))


def test_the_shipped_table_offers_what_each_collective_has():
    table = tuning.load(str(tuning.DEFAULT_TABLE))
    assert set(table.times_us) == {2, 4} and set(table.recorded) == {2, 4} and table.machine  # where it holds
    for world, by_collective in table.times_us.items():
        in_place = {c + tuning.IN_PLACE for c in RING_COLLECTIVES}  # auto's choice for in-place calls
        assert set(by_collective) == set(RING_COLLECTIVES) | {"broadcast"} | in_place  # reduce: native (no table yet)
        for key, by_name in by_collective.items():
            collective = key.removesuffix(tuning.IN_PLACE)
            assert "native" in by_name and set(by_name) <= set(plans.algorithms(collective)) - {"auto"}
            assert {name for _, name in table.bands(collective, world)} <= set(by_name)
