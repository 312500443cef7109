"""The console: help for every command, outputs written, user mistakes without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from executor.cli import main
from tests.helpers import uniform_profile

COMMANDS = ["profile", "run", "calibrate", "demo", "simulate", "tune", "compare"]


def test_console_script_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "executor.cli", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for command in COMMANDS:
        assert command in out


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: pipesim " + command in capsys.readouterr().out


@pytest.fixture
def profile_path(tmp_path):
    return uniform_profile(4, fwd_s=1e-3, bwd_s=2e-3, sizes=(1, 64)).save(tmp_path / "p.csv")


def test_simulate_writes_pictures_and_traces(profile_path, tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["simulate", str(profile_path), "--balance", "2,2", "--chunks", "4",
                 "--batch-size", "8", "--schedule", "1f1b", "--cluster", "cpu",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "predicted iteration" in text and "device 1" in text
    for name in ("simulated.png", "simulated_chrome.json", "simulated_actions.csv",
                 "simulated_memory.csv", "simulated_metrics.json"):
        assert (out / name).exists(), name
    chrome = json.loads((out / "simulated_chrome.json").read_text())
    assert any(e["name"] == "1F0" for e in chrome["traceEvents"])


def test_simulate_threads_placed_freely_or_on_one_core(profile_path, tmp_path, capsys):
    # the same plan as stage threads each on a core of its own, and all on one core
    # (`run --transport threads --cores 1`): there the workers' actions never overlap
    import pandas as pd

    starts = {}
    for preset in ("cpu-threads", "cpu-threads-1core"):
        out = tmp_path / preset
        assert main(["simulate", str(profile_path), "--balance", "2,2", "--chunks", "4",
                     "--batch-size", "8", "--cluster", preset, "--out", str(out)]) == 0
        acts = pd.read_csv(out / "simulated_actions.csv").query("kind in ['F', 'B']")
        acts = acts.sort_values("start")
        starts[preset] = (acts.start.iloc[1:].to_numpy() < acts.end.iloc[:-1].to_numpy() - 1e-12
                          ).any()
    assert starts == {"cpu-threads": True, "cpu-threads-1core": False}


def test_simulate_and_tune_every_schedule(profile_path, tmp_path, capsys):
    assert main(["simulate", str(profile_path), "--stages", "4", "--chunks", "4",
                 "--batch-size", "8", "--schedule", "zbv", "--out", str(tmp_path / "zbv")]) == 0
    actions = (tmp_path / "zbv" / "simulated_actions.csv").read_text()
    assert ",I," in actions and ",W," in actions
    assert main(["tune", str(profile_path), "--batch-size", "16", "--schedules", "all",
                 "--out", str(tmp_path / "t")]) == 0
    table = (tmp_path / "t" / "tune.csv").read_text()
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv"):
        assert f",{name}," in table, name


def test_tune_and_its_impossible_budget(profile_path, tmp_path, capsys):
    assert main(["tune", str(profile_path), "--devices", "2", "--batch-size", "16",
                 "--memory-budget", "1GiB", "--out", str(tmp_path / "t")]) == 0
    assert "best:" in capsys.readouterr().out
    assert json.loads((tmp_path / "t" / "best_plan.json").read_text())["batch_size"] == 16
    assert main(["tune", str(profile_path), "--memory-budget", "10B"]) == 2
    assert "smallest peak any plan needs" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["simulate", "missing.csv"], "missing.csv: no such profile file"),
    (["simulate", "{profile}", "--balance", "1,1"], "sums to 2 layers but the model has 4"),
    (["simulate", "{profile}", "--balance", "2,x"], "--balance must be comma-separated integers"),
    (["simulate", "{profile}", "--chunks", "0"], "--chunks: must be an integer of at least 1, got 0"),
    (["simulate", "{profile}", "--cluster", "moon"], "cluster 'moon' is neither a preset"),
    (["simulate", "{profile}", "--iterations", "0"], "--iterations: must be an integer of at least"),
    (["simulate", "{profile}", "--jitter", "-1"], "--jitter: must be a finite number of at least 0"),
    (["simulate", "{profile}", "--cluster", "{few}"], "the plan needs 2 devices, the cluster has 1"),
    (["simulate", "{profile}", "--cluster", "{bad}"], "malformed cluster description"),
    (["tune", "{profile}", "--memory-budget", "lots"], "cannot read a memory size from 'lots'"),
    (["tune", "{profile}", "--memory-budget", "-5MiB"], "memory budget must be positive"),
    (["tune", "{profile}", "--chunks", "0,3"], "--chunks must be positive integers"),
    (["compare", "nowhere", "nothere"], "no such trace file"),
    (["profile", "--model", "vgg"], "unknown model 'vgg'"),
    (["profile", "--sizes", "0,2"], "--sizes must be positive integers"),
    (["profile", "--sizes", "-1"], "--sizes must be positive integers"),
    (["profile", "--sizes", ""], "--sizes needs at least one integer"),
    (["profile", "--repeats", "0"], "--repeats: must be an integer of at least 1"),
    (["profile", "--dtype", "int8"], "not a floating-point torch dtype"),
    (["profile", "--device", "cuda:7"], "--device 'cuda:7'"),
    (["run", "--iterations", "0"], "--iterations: must be an integer of at least 1"),
    (["run", "--plan", "nowhere.json"], "nowhere.json: cannot read a plan"),
    (["calibrate", "--stages", "1"], "--stages 1: a pipeline's workers are 2 or more"),
    (["calibrate", "--transport", "threads", "--idle-costs", "{profile}", "--stage-costs",
      "{profile}"], "--idle-costs and --stage-costs: one or the other"),
    (["calibrate", "--balance", "2,2"], "--balance 2,2: the balance measured in place"),
    (["calibrate", "--transport", "threads", "--pin"], "--pin is for --transport processes"),
    (["calibrate", "--transport", "threads", "--device", "cuda:7"], "--device 'cuda:7'"),
    (["calibrate", "--stage-costs", "{profile}"], "--stage-costs is for --transport threads"),
    (["calibrate", "--device", "cuda"], "the processes transport runs on the CPU"),
    (["calibrate", "--transport", "threads", "--stage-costs", "{profile}", "--balance", "2,2",
      "--balance", "1,1,2"], "--balance 1,1,2 has 3 stages, --stages is 2"),
    (["calibrate", "--transport", "threads", "--stage-costs", "nowhere.csv"],
     "--stage-costs nowhere.csv:"),
    (["profile", "--streams", "1"], "--streams 1: the device's sharing needs 2 or more threads"),
    (["calibrate", "--idle-costs", "nowhere.csv"], "--idle-costs nowhere.csv:"),
    (["calibrate", "--idle-costs", "{profile}", "--batch-size", "1", "--model", "mlp"],
     "has 4 layers, model 'mlp' 9"),
    (["calibrate", "--idle-costs", "{profile}", "--balance", "1,1,2"], "has 3 stages, --stages is 2"),
    (["run", "--transport", "processes", "--cores", "1"], "--cores 1 is for --transport threads"),
    (["calibrate", "--cores", "1"], "--cores 1 is for --transport threads (processes: --pin)"),
    (["run", "--cores", "4096"], "--cores 4096: cores must be 1 to"),
    (["calibrate", "--transport", "threads", "--device", "cuda:7", "--cores", "1"],
     "--cores 1 with --device cuda:7: for stage threads on the CPU"),
])
def test_user_mistakes_are_one_line_errors(argv, message, profile_path, tmp_path, capsys):
    from pipesim.cluster import Cluster

    few = Cluster.free(1).save(tmp_path / "few.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"devices": [{"name": "a"}, {"name": "b"}],
                               "link": {"latency_s": "fast"}}))
    argv = [a.replace("{profile}", str(profile_path)).replace("{few}", str(few))
            .replace("{bad}", str(bad)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.startswith("pipesim: error:") and err.count("\n") == 1  # one line


#: a 4-layer MLP small enough to profile and run in a second
TINY_MLP = ["--model", "mlp", "--set", "width=16", "--set", "depth=3", "--set", "in_features=8"]


def _tiny_profile(tmp_path, sizes: str) -> Path:
    """A one-repeat profile of :data:`TINY_MLP` at ``sizes`` (``"1,2,4"``)."""
    prof_out = tmp_path / "p.csv"
    assert main(["profile", *TINY_MLP, "--sizes", sizes, "--repeats", "1", "--warmup", "0",
                 "--out", str(prof_out)]) == 0
    return prof_out


def test_run_with_profile_compares(tmp_path, capsys):
    small, prof_out = TINY_MLP, _tiny_profile(tmp_path, "1,2,4")
    out = tmp_path / "run"
    assert main(["run", *small, "--balance", "2,2", "--chunks", "4", "--batch-size", "8",
                 "--iterations", "2", "--warmup", "1", "--profile", str(prof_out),
                 "--out", str(out)]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "measured  iteration" in text and "compare   iteration" in text
    # predicted by a preset: the command that measures this machine's, for this plan
    assert ("predicted with the cpu-threads preset; this machine's: `pipesim calibrate "
            f"--transport threads --idle-costs {prof_out} --model mlp --set width=16 --set "
            "depth=3 --set in_features=8 --balance 2,2 --batch-size 8`") in text
    # stage threads on the CPU, a profile without the interpreter's shares: said, not hidden
    assert "has no interpreter shares" in captured.err and "--interpreter" in captured.err
    assert (out / "compare.png").exists() and (out / "measured_actions.csv").exists()
    assert (out / "compare_memory.png").exists()  # predicted by category, measured total
    assert (out / "simulated_memory_by_category.csv").exists()
    assert main(["compare", str(out), str(out), "--out", str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp" / "compare_actions.csv").exists()
    assert (tmp_path / "cmp" / "compare_memory.png").exists()


def test_run_on_one_core_predicts_its_threads_taking_turns_there(tmp_path, capsys):
    import os

    import pandas as pd

    small, prof_out = TINY_MLP, _tiny_profile(tmp_path, "2,4")
    out = tmp_path / "run"
    mine = os.sched_getaffinity(0)
    assert main(["run", *small, "--balance", "2,2", "--chunks", "2", "--batch-size", "8",
                 "--iterations", "2", "--warmup", "1", "--profile", str(prof_out),
                 "--cores", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "with 2 threads on 1 core(s)" in text
    assert os.sched_getaffinity(0) == mine  # every thread back where it was
    # predicted by the one-core preset; the hint measures this machine's in that placement
    assert "predicted with the cpu-threads-1core preset" in text
    assert "--cores 1 --balance 2,2" in text
    # the prediction's workers took turns on one core: never two actions at once
    pred = pd.read_csv(out / "simulated_actions.csv").query("kind in ['F', 'B']")
    pred = pred.sort_values("start")
    assert (pred.start.iloc[1:].to_numpy() >= pred.end.iloc[:-1].to_numpy() - 1e-12).all()
    # a calibrated cluster of threads on their own cores, for a run on one: said
    from pipesim.cluster import Cluster

    apart = Cluster.cpu_threads(2, cores=2).save(tmp_path / "apart.json")
    again = ["run", *small, "--balance", "2,2", "--chunks", "2", "--batch-size", "8",
             "--iterations", "1", "--warmup", "0", "--profile", str(prof_out),
             "--out", str(out)]
    assert main([*again, "--cores", "1", "--cluster", str(apart)]) == 0
    assert (f"{apart} has the threads on 2 core(s), this run on 1: calibrate again with "
            "--cores 1") in capsys.readouterr().err
    if len(mine) > 1:  # and the other way round
        one = Cluster.cpu_threads(2, cores=1).save(tmp_path / "one.json")
        assert main([*again, "--cluster", str(one)]) == 0
        assert "has the threads on 1 core(s), this run on 2: calibrate again without --cores" \
            in capsys.readouterr().err


def test_calibrate_writes_a_cluster_whose_idle_costs_the_simulator_reads(tmp_path, capsys,
                                                                        monkeypatch):
    import executor.calibrate
    from pipesim.cluster import Cluster

    # the links and overheads (calibrate_cpu, ~20 s) are measured for real by the demo's
    # test; here a preset stands in for them, and the idle costs are measured for real
    monkeypatch.setattr(executor.calibrate, "calibrate_cpu",
                        lambda n, **kw: Cluster.cpu_processes(n))
    small = ["--model", "mlp", "--set", "width=16", "--set", "depth=3", "--set", "in_features=8"]
    prof = tmp_path / "p.csv"
    assert main(["profile", *small, "--sizes", "2,4", "--repeats", "1", "--warmup", "0",
                 "--out", str(prof)]) == 0
    out = tmp_path / "cluster.json"
    assert main(["calibrate", *small, "--idle-costs", str(prof), "--balance", "1,3",
                 "--batch-size", "4", "--idle-rounds", "1", "--contention-repeats", "1",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "stage 0 B" in text and "plans of balance [1, 3] pay them" in text
    cluster = Cluster.load(out)
    rows = cluster.idle_costs
    # both stages' forwards, the first stage's backward, plain and checkpointed, per size
    # and idle (the last stage's backward starts from its own loss: never after a wait)
    assert {(r.first, r.stop, r.kind, r.checkpointed) for r in rows} == {
        (0, 1, "F", False), (0, 1, "F", True), (0, 1, "B", False), (0, 1, "B", True),
        (1, 4, "F", False), (1, 4, "F", True)}
    assert {r.micro_batch for r in rows} == {2, 4} and all(r.profile_s > 0 for r in rows)
    # what the simulator reads: a curve from idle 0 for the measured stages, none elsewhere
    curve = cluster.idle_cost(0, 1, 2, False, "B")
    assert curve[0][0] == 0.0 and [p[0] for p in curve[1:]] == sorted({r.idle_s for r in rows})
    assert cluster.idle_cost(0, 2, 2, False, "B") == ()
    # checkpointing's extra on every stage's backward, per size (read where no curve is)
    assert "stage 1 B checkpointed, seconds more than plain" in text
    assert sorted((x.first, x.stop, x.micro_batch) for x in cluster.checkpoint_extras) == [
        (0, 1, 2), (0, 1, 4), (1, 4, 2), (1, 4, 4)]
    # and each stage's own executor seconds between actions, beside the calibration
    # pipeline's figure they are read against
    assert "executor's own seconds around an action" in text
    assert cluster.executor_gap_base_s > 0
    assert sorted((x.first, x.micro_batch, x.checkpointed) for x in cluster.executor_gaps) == [
        (f, b, c) for f in (0, 1) for b in (2, 4) for c in (False, True)]
    # and how much each stage slows beside the other computing, per size (on top of the
    # host contention: pipesim.readings.SpanSlowdown)
    assert "stage 1 beside the others computing" in text
    assert sorted((x.first, x.stop, x.micro_batch) for x in cluster.host_slowdowns) == [
        (0, 1, 2), (0, 1, 4), (1, 4, 2), (1, 4, 4)]
    assert all(x.slowdown >= 1.0 for x in cluster.host_slowdowns)
    assert main(["simulate", str(prof), "--balance", "1,3", "--chunks", "2", "--batch-size", "4",
                 "--cluster", str(out), "--out", str(tmp_path / "sim")]) == 0


def test_calibrate_threads_measures_idle_costs_and_extras_in_this_process(tmp_path, capsys):
    from pipesim.cluster import Cluster

    small = ["--model", "mlp", "--set", "width=16", "--set", "depth=3", "--set", "in_features=8"]
    prof = tmp_path / "p.csv"
    assert main(["profile", *small, "--sizes", "2,4", "--repeats", "1", "--warmup", "0",
                 "--interpreter", "--out", str(prof)]) == 0
    out = tmp_path / "cluster.json"
    # two balances (the tuner's candidates should all be priced alike: pipesim.tune)
    assert main(["calibrate", "--transport", "threads", *small, "--idle-costs", str(prof),
                 "--balance", "1,3", "--balance", "2,2", "--batch-size", "4",
                 "--idle-rounds", "1", "--in-place-rounds", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "each stage in this process" in text and "stage 0 B, seconds more after" in text
    assert "stage 1 B checkpointed, seconds more than plain" in text
    assert "plans of balance [1, 3], [2, 2] pay them" in text
    cluster = Cluster.load(out)
    # the stage threads' cluster, with the idle costs read against the profile: both
    # stages' forwards and the first one's backward, plain and checkpointed, at both
    # sizes, for each balance
    assert {d.process for d in cluster.devices} == {"main"}
    first_kinds, last_kinds = ("F", "B"), ("F",)
    assert {(r.first, r.stop, r.kind, r.checkpointed) for r in cluster.idle_costs} == {
        (first, stop, kind, c) for first, stop, kinds in ((0, 1, first_kinds), (1, 4, last_kinds),
                                                          (0, 2, first_kinds), (2, 4, last_kinds))
        for kind in kinds for c in (False, True)}
    assert {r.micro_batch for r in cluster.idle_costs} == {2, 4}
    assert all(r.profile_s > 0 and r.hot_s > 0 for r in cluster.idle_costs)
    assert sorted((x.first, x.stop, x.micro_batch) for x in cluster.checkpoint_extras) == [
        (0, 1, 2), (0, 1, 4), (0, 2, 2), (0, 2, 4), (1, 4, 2), (1, 4, 4), (2, 4, 2), (2, 4, 4)]
    # what the simulator reads: a curve from idle 0 for the measured stages
    assert cluster.idle_cost(0, 1, 2, False, "B")[0][0] == 0.0
    assert main(["simulate", str(prof), "--balance", "1,3", "--chunks", "2", "--batch-size", "4",
                 "--cluster", str(out), "--out", str(tmp_path / "sim")]) == 0


def test_calibrate_threads_measures_each_stage_of_each_balance_in_place(tmp_path, capsys):
    from executor.cli import default_cluster
    from pipesim.cluster import Cluster
    from pipesim.profile import Profile
    from pipesim.simulator import simulate
    from pipesim.tune import tuned_balances

    small = ["--model", "mlp", "--set", "width=16", "--set", "depth=3", "--set", "in_features=8"]
    prof = tmp_path / "p.csv"
    # the stage threads' sharing measured with the profile: the device's law and the
    # interpreter's shares at each size
    assert main(["profile", *small, "--sizes", "2,4", "--repeats", "1", "--warmup", "0",
                 "--streams", "2", "--interpreter", "--out", str(prof)]) == 0
    profile = Profile.load(prof)
    assert profile.stream_speedup(2)[0] == 1.0 and len(profile.stream_speedup(4)) == 2
    assert profile.interpreter_share(4) is not None
    out = tmp_path / "cluster.json"
    # every balance the tuner tries at 4 samples ([2, 2] and its neighbours; one named
    # too is measured once)
    assert main(["calibrate", "--transport", "threads", *small, "--stage-costs", str(prof),
                 "--balance", "tuned", "--balance", "1,3",
                 "--batch-size", "4", "--in-place-rounds", "1", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "warning" not in captured.err  # the profile has what stage threads need
    assert "calibrating 2 threads on cpu" in text and "ms between actions" in text
    assert "stage 1 4 samples checkpointed: forward" in text
    # (which balances the tuner tries follows the profile: a tiny model's noisy one can
    # make [1, 3] or [3, 1] the partition, and its neighbours differ)
    tried = tuned_balances(profile, 2, 4)
    tried += [[1, 3]] if [1, 3] not in tried else []
    listed = ", ".join(str(b) for b in tried)
    assert f"plans of balance {listed} cost what was measured" in text
    cluster = Cluster.load(out)
    # threads of one process, each on a core, with the overheads measured
    assert {d.process for d in cluster.devices} == {"main"} and cluster.action_gap_s > 0
    # every stage of each balance, plain and checkpointed, at both sizes
    assert {(x.first, x.stop) for x in cluster.in_place_costs} == {
        span for b in tried for span in ((0, b[0]), (b[0], 4))}
    assert {(x.micro_batch, x.checkpointed) for x in cluster.in_place_costs} == {
        (b, c) for b in (2, 4) for c in (False, True)}
    assert all(x.fwd_s > 0 and x.bwd_s > 0 for x in cluster.in_place_costs)
    # the simulator costs a measured balance's actions as measured, another's by the profile
    row = next(x for x in cluster.in_place_costs
               if (x.first, x.stop, x.micro_batch, x.checkpointed) == (0, 1, 2, False))
    assert cluster.in_place_cost(0, 1, 2, False) == (row.fwd_s, row.bwd_s)
    assert cluster.in_place_cost(1, 3, 2, False) is None  # no stage of a 2-stage balance
    from pipesim.plan import Plan

    plan = Plan([1, 3], 2, 4, checkpoint="never")
    f0 = next(a for a in simulate(profile, plan, cluster).actions.itertuples()
              if a.kind == "F" and a.stage == 0)  # (alone: the other thread waits for it)
    assert f0.end - f0.start == pytest.approx(row.fwd_s, rel=1e-6)  # its overhead measured
    # the tuner ranks its candidates by one ruler: all priced in place, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["tune", str(prof), "--batch-size", "4", "--cluster", str(out),
                     "--out", str(tmp_path / "tune")]) == 0
    # a threads run's prediction defaults to the threads' preset, a processes run's to cpu
    assert [default_cluster(t, d) for t, d in (("processes", "cpu"), ("threads", "cpu"),
                                               ("threads", "cuda:1"))] == [
        "cpu", "cpu-threads", "shared-gpu"]


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path, capsys):
    assert main(["demo", "--quick", "--out", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "outputs" in out
    assert (tmp_path / "demo" / "profile.csv").exists()
    assert (tmp_path / "demo" / "simulated_plans.csv").exists()


def test_compare_refuses_traces_of_different_plans(profile_path, tmp_path, capsys):
    for name, chunks in (("a", "4"), ("b", "2")):
        assert main(["simulate", str(profile_path), "--balance", "2,2", "--chunks", chunks,
                     "--batch-size", "8", "--out", str(tmp_path / name)]) == 0
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--measured-prefix",
                 "simulated", "--out", str(tmp_path / "c")]) == 2
    assert "different plans: predicted gpipe [2,2] m=4" in capsys.readouterr().err


def test_output_piped_into_head_ends_quietly(profile_path):
    cmd = (f"{sys.executable} -m executor.cli tune {profile_path} --batch-size 16 "
           f"--out {profile_path.parent / 't'} | head -1")
    done = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr
    assert done.returncode == 0


def test_version_and_model_names():
    from executor.cli import MODEL_NAMES
    from executor.models import BUILTIN_MODELS

    assert sorted(MODEL_NAMES) == sorted(BUILTIN_MODELS)
    out = subprocess.run([sys.executable, "-m", "executor.cli", "--version"], capture_output=True,
                         text=True, check=True).stdout
    assert out.startswith("pipesim ")


def test_on_a_gpu_simulate_and_tune_show_the_estimated_reserved_memory(profile_path, tmp_path,
                                                                       capsys):
    assert main(["simulate", str(profile_path), "--balance", "2,2", "--batch-size", "8",
                 "--cluster", "shared-gpu", "--out", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "reserved ~" in out and "with workspaces ~" in out
    assert main(["tune", str(profile_path), "--batch-size", "8", "--cluster", "shared-gpu",
                 "--out", str(tmp_path / "t")]) == 0
    assert "reserved_MiB" in capsys.readouterr().out
    assert main(["simulate", str(profile_path), "--balance", "2,2", "--batch-size", "8",
                 "--cluster", "cpu", "--out", str(tmp_path / "c")]) == 0
    assert "reserved" not in capsys.readouterr().out


def test_simulate_says_when_a_plan_does_not_fit(profile_path, tmp_path, capsys):
    from pipesim.cluster import Cluster, Device

    tiny = Cluster([Device("a", memory_bytes=1000), Device("b", memory_bytes=1000)]).save(
        tmp_path / "tiny.json")
    assert main(["simulate", str(profile_path), "--balance", "2,2", "--batch-size", "8",
                 "--cluster", str(tiny), "--out", str(tmp_path / "s")]) == 0
    assert "DOES NOT FIT: the device holds 1000 B" in capsys.readouterr().out
    assert main(["tune", str(profile_path), "--batch-size", "8", "--cluster", str(tiny),
                 "--out", str(tmp_path / "t")]) == 2
    assert "no plan fits 0.001 MiB per device" in capsys.readouterr().err


def test_run_checks_the_profile_before_running_and_accepts_a_tuned_plan(tmp_path, capsys):
    small = ["--model", "mlp", "--set", "width=16", "--set", "depth=3", "--set", "in_features=8"]
    prof = tmp_path / "p.csv"
    assert main(["profile", *small, "--sizes", "1,2", "--repeats", "1", "--warmup", "0",
                 "--out", str(prof)]) == 0
    # micro-batches of 8 are outside the profiled 1..2: refused at once, nothing run
    assert main(["run", *small, "--balance", "2,2", "--chunks", "1", "--batch-size", "8",
                 "--profile", str(prof), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "outside" in err and not (tmp_path / "r").exists()
    assert main(["tune", str(prof), "--batch-size", "4", "--out", str(tmp_path / "t")]) == 0
    assert main(["run", *small, "--plan", str(tmp_path / "t" / "best_plan.json"),
                 "--batch-size", "4", "--iterations", "1", "--warmup", "0", "--threads", "2",
                 "--profile", str(prof), "--out", str(tmp_path / "r2")]) == 0
    captured = capsys.readouterr()
    assert "measured  iteration" in captured.out
    assert "measured with 1 torch threads, this run uses 2" in captured.err
