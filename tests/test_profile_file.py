"""The Profile file format: round trips, and every bad file named precisely."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pipesim import Profile, ProfileError, ProfileRangeError, span_memory, split_sizes
from tests.helpers import uniform_profile


def write_table(tmp_path, table: pd.DataFrame, name: str = "bad.csv"):
    path = tmp_path / name
    table.to_csv(path, index=False)
    return path


def test_round_trip_keeps_table_and_metadata(tmp_path):
    prof = uniform_profile(3, sizes=(1, 4, 16))
    prof.meta.update({"device": "cpu", "threads": 2})
    path = prof.save(tmp_path / "p.csv")
    back = Profile.load(path)
    pd.testing.assert_frame_equal(back.table, prof.table)
    assert back.meta == prof.meta
    assert back.source == str(path)


def test_files_are_plain_csv_and_json(tmp_path):
    path = uniform_profile(2).save(tmp_path / "p")
    assert path.suffix == ".csv"
    assert path.read_text().splitlines()[0].startswith("layer,name,micro_batch,fwd_s")
    assert path.with_suffix(".json").exists()


@pytest.fixture
def good_table():
    return uniform_profile(2, sizes=(1, 2)).table.copy()


def test_missing_column_is_named(tmp_path, good_table):
    path = write_table(tmp_path, good_table.drop(columns=["bwd_s"]))
    with pytest.raises(ProfileError, match=r"bad\.csv: missing column\(s\) 'bwd_s'"):
        Profile.load(path)


def test_nan_time_names_column_and_row(tmp_path, good_table):
    good_table["fwd_s"] = good_table["fwd_s"].astype(object)
    good_table.loc[2, "fwd_s"] = np.nan
    path = write_table(tmp_path, good_table)
    with pytest.raises(ProfileError, match=r"bad\.csv: column 'fwd_s', row 3"):
        Profile.load(path)


def test_negative_time_names_column_and_row(tmp_path, good_table):
    good_table.loc[1, "bwd_s"] = -0.5
    path = write_table(tmp_path, good_table)
    with pytest.raises(ProfileError, match=r"column 'bwd_s', row 2: -0.5 is negative"):
        Profile.load(path)


def test_duplicated_layer_size_row(tmp_path, good_table):
    table = pd.concat([good_table, good_table.iloc[[0]]], ignore_index=True)
    path = write_table(tmp_path, table)
    with pytest.raises(ProfileError, match=r"row 5 duplicates \(layer=0, micro_batch=1\)"):
        Profile.load(path)


def test_wrong_type_names_the_cell(tmp_path, good_table):
    good_table["output_bytes"] = good_table["output_bytes"].astype(object)
    good_table.loc[3, "output_bytes"] = "lots"
    path = write_table(tmp_path, good_table)
    with pytest.raises(ProfileError, match=r"column 'output_bytes', row 4: 'lots' is not a number"):
        Profile.load(path)


def test_fractional_integer_column(tmp_path, good_table):
    good_table["micro_batch"] = good_table["micro_batch"].astype(float)
    good_table.loc[0, "micro_batch"] = 1.5
    path = write_table(tmp_path, good_table)
    with pytest.raises(ProfileError, match=r"column 'micro_batch', row 1: '1.5' is not an integer"):
        Profile.load(path)


def test_layer_without_every_size(tmp_path, good_table):
    path = write_table(tmp_path, good_table.drop(index=3))
    with pytest.raises(ProfileError, match=r"layer 1 lacks micro_batch size\(s\) \[2\]"):
        Profile.load(path)


def test_missing_file_and_bad_metadata(tmp_path, good_table):
    with pytest.raises(ProfileError, match="no such profile file"):
        Profile.load(tmp_path / "nope.csv")
    path = write_table(tmp_path, good_table, "p.csv")
    path.with_suffix(".json").write_text("{not json")
    with pytest.raises(ProfileError, match=r"p\.json: metadata is not valid JSON"):
        Profile.load(path)


def test_whole_model_readings_are_validated(tmp_path, good_table):
    import json

    path = write_table(tmp_path, good_table, "p.csv")
    for whole, message in (
            ({"1": {"bwd_s": 2.0}}, r"p\.csv: meta\['whole_model'\]\['1'\] has no 'fwd_s'"),
            ({"1": {"fwd_s": 1.0, "bwd_s": 0.0}},
             r"\['1'\]\['bwd_s'\] must be positive seconds, got 0\.0"),
            ({"1": {"fwd_s": 1.0, "bwd_s": 2.0, "ckpt_bwd_s": "slow"}},
             r"\['1'\]\['ckpt_bwd_s'\] must be non-negative seconds, got 'slow'"),
            ({"1": [1.0, 2.0]}, r"\['1'\] must be a mapping of seconds"),
            ([1.0], r"must map a micro-batch size to its seconds, got list")):
        path.with_suffix(".json").write_text(json.dumps({"whole_model": whole}))
        with pytest.raises(ProfileError, match=message):
            Profile.load(path)


def test_loading_never_changes_the_file(tmp_path, good_table):
    good_table.loc[0, "fwd_s"] = -1.0
    path = write_table(tmp_path, good_table)
    before = path.read_bytes()
    with pytest.raises(ProfileError):
        Profile.load(path)
    assert path.read_bytes() == before


def test_interpolates_linearly_inside_the_range():
    prof = uniform_profile(2, fwd_s=1.0, sizes=(2, 8))
    assert prof.at(0, 5)["fwd_s"] == pytest.approx(5.0)
    assert prof.at(1, 2)["output_bytes"] == pytest.approx(200)


def test_refuses_outside_the_range_unless_asked():
    prof = uniform_profile(2, sizes=(2, 8))
    with pytest.raises(ProfileRangeError, match=r"size 16 is outside the profiled range \[2, 8\]"):
        prof.at(0, 16)
    with pytest.warns(UserWarning, match="extrapolating"):
        assert prof.at(0, 16, extrapolate=True)["fwd_s"] == pytest.approx(16.0)


def test_span_counts_shared_boundary_tensors_once():
    rows = []
    # layer 0 saves its output (like ReLU); layer 1 saves its input (like Linear): one tensor
    for layer, (s_in, s_out) in enumerate([(0, 100), (100, 0)]):
        rows.append(dict(layer=layer, name="L", micro_batch=1, fwd_s=1, bwd_s=1, input_bytes=100,
                         output_bytes=100, saved_bytes=s_in + s_out + 50, saved_input_bytes=s_in,
                         saved_output_bytes=s_out, param_bytes=0))
    span = Profile(pd.DataFrame(rows)).span_cost(0, 2, 1)
    # 50 + 50 internals, one shared boundary tensor (100), the stage output kept (100)
    assert span.stash_bytes == 300


def test_a_forward_rise_is_what_the_layers_before_kept_its_loose_input_what_it_makes_and_temps():
    # three layers, bytes: 0 saves its input and output (4 + 8), 1 saves its input (0's
    # output, one storage) and 12 of its own, 2 saves 30 of its own but not its input
    cols = {name: np.array(v, dtype=float) for name, v in {
        "saved_bytes": [12, 20, 30], "saved_input_bytes": [4, 8, 0],
        "saved_output_bytes": [8, 0, 0], "input_bytes": [4, 8, 16],
        "output_bytes": [8, 16, 2], "fwd_transient_bytes": [1, 2, 3]}.items()}
    through = span_memory.stash_flags(0, cols, pass_through=())
    own = span_memory.own_saved(cols, through)
    assert own.tolist() == [8, 12, 30]  # the received input and the shared boundary aside
    # kept before + loose input + (output + what it saves beyond them) + temporaries
    assert span_memory.forward_rise(cols, through, own).tolist() == [
        0 + 0 + (8 + 0) + 1, 8 + 0 + (16 + 12) + 2, 20 + 16 + (2 + 30) + 3]
    # kept to the backward: every saved byte once (the 8 shared) and the stage output
    assert span_memory.stash_bytes(cols, through, loss_span=False) == (62 - 8 + 2, 0.0)


@pytest.mark.parametrize(("batch", "chunks", "sizes"), [
    (8, 4, [2, 2, 2, 2]), (10, 4, [3, 3, 3, 1]), (5, 4, [2, 2, 1]), (3, 3, [1, 1, 1])])
def test_split_sizes_follow_tensor_chunk(batch, chunks, sizes):
    assert split_sizes(batch, chunks) == sizes


def test_isolation_excess_is_removed_per_internal_boundary():
    prof = uniform_profile(5, fwd_s=1.0, bwd_s=2.0, sizes=(1, 4))
    # the whole model measured 0.8x the per-layer sums: 1 s forward and 2 s backward lost
    # per sample over the 4 internal boundaries
    prof.meta["whole_model"] = {"1": {"fwd_s": 4.0, "bwd_s": 8.0},
                                "4": {"fwd_s": 16.0, "bwd_s": 32.0}}
    assert prof.span_cost(0, 1, 2).fwd_s == pytest.approx(2.0)  # one layer: as profiled
    assert prof.span_cost(0, 5, 2).fwd_s == pytest.approx(8.0)  # all: the whole model
    assert prof.span_cost(0, 5, 2).bwd_s == pytest.approx(16.0)
    assert prof.span_cost(1, 4, 2).fwd_s == pytest.approx(6.0 - 2 / 4 * 2.0)  # 2 of 4 boundaries
    back = Profile(prof.table, dict(prof.meta))
    assert back.isolation_excess(2) == pytest.approx((2.0, 4.0))


def test_without_whole_model_times_spans_are_plain_sums():
    prof = uniform_profile(3, sizes=(1, 4))
    assert prof.isolation_excess(2) is None
    assert prof.span_cost(0, 3, 2).fwd_s == pytest.approx(6.0)


def test_checkpoint_costs_are_paid_by_checkpointed_micro_batches_only(tmp_path):
    from pipesim.plan import Plan
    from pipesim.simulator import simulate
    from tests.helpers import uniform_profile

    plain = uniform_profile(2, fwd_s=1.0, bwd_s=2.0, sizes=(1, 4))
    t = plain.table.copy()
    t["ckpt_fwd_s"] = t["fwd_s"] + 0.5 * t["micro_batch"]  # the checkpoint adds 0.5 s a sample
    t["ckpt_bwd_s"] = t["fwd_s"] + t["bwd_s"] + 0.25 * t["micro_batch"]
    costly = Profile(t, plain.meta)
    back = Profile.load(costly.save(tmp_path / "c.csv"))  # the optional columns round-trip
    assert back.optional_columns == ("ckpt_fwd_s", "ckpt_bwd_s")
    plan = Plan([1, 1], 2, 2, checkpoint="except_last")
    a = simulate(back, plan).actions.set_index(["stage", "kind", "microbatch"])
    dur = (a["end"] - a["start"]).to_dict()
    assert dur[(0, "F", 0)] == pytest.approx(1.5)  # checkpointed: 1 + 0.5
    assert dur[(0, "F", 1)] == pytest.approx(1.0)  # the last micro-batch is not
    assert dur[(0, "B", 0)] == pytest.approx(2.0 + 1.0 + 0.25)  # backward, recompute, extra
    assert dur[(0, "B", 1)] == pytest.approx(2.0)
    # a profile without the columns (an old file) pays one more forward and nothing else
    old = simulate(plain, plan).actions.set_index(["stage", "kind", "microbatch"])
    assert (old["end"] - old["start"])[(0, "F", 0)] == pytest.approx(1.0)


def test_the_mean_of_profiles_averages_seconds_and_keeps_bytes():
    a = uniform_profile(3, sizes=(1, 2))
    slow = a.table.copy()
    slow[["fwd_s", "bwd_s"]] *= 3
    b = Profile(slow, {**a.meta, "whole_model": {"1": {"fwd_s": 3.0, "bwd_s": 6.0}}})
    a = Profile(a.table, {**a.meta, "whole_model": {"1": {"fwd_s": 1.0, "bwd_s": 2.0}}})
    mean = Profile.mean([a, b])
    assert mean.table.fwd_s.tolist() == pytest.approx((2 * a.table.sort_values(
        ["layer", "micro_batch"]).fwd_s).tolist())
    assert mean.table.saved_bytes.tolist() == a.table.sort_values(
        ["layer", "micro_batch"]).saved_bytes.tolist()
    assert mean.meta["whole_model"] == {"1": {"fwd_s": 2.0, "bwd_s": 4.0}}
    assert mean.meta["averaged_over"] == 2
    with pytest.raises(ProfileError, match="different models"):
        Profile.mean([a, uniform_profile(4, sizes=(1, 2))])


def test_the_median_of_profiles_ignores_one_moment_read_slow():
    def at(speed):
        t = uniform_profile(3, sizes=(1, 2)).table
        t[["fwd_s", "bwd_s"]] *= speed
        return Profile(t, {"whole_model": {"1": {"fwd_s": speed, "bwd_s": 2 * speed}}})

    readings = [at(1.0), at(1.1), at(0.9), at(1.0), at(1.6)]  # the last: a busy moment
    median = Profile.median(readings)
    one = at(1.0).table.sort_values(["layer", "micro_batch"])
    assert median.table.fwd_s.tolist() == pytest.approx(one.fwd_s.tolist())
    assert median.table.bwd_s.tolist() == pytest.approx(one.bwd_s.tolist())
    assert median.meta["whole_model"] == {"1": {"fwd_s": 1.0, "bwd_s": 2.0}}
    assert median.meta["combined_by"] == "median" and median.meta["averaged_over"] == 5
    # the mean follows the busy moment
    assert Profile.mean(readings).table.fwd_s.tolist() == pytest.approx(
        (1.12 * one.fwd_s).tolist())
    assert "combined_by" not in Profile.mean(readings).meta
    with pytest.raises(ProfileError, match="median needs"):
        Profile.median([])
