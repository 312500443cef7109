"""The console: help for every command, outputs written, user mistakes without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from executor.cli import main
from tests.helpers import uniform_profile

COMMANDS = ["profile", "run", "demo", "simulate", "tune", "compare"]


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
    (["simulate", "{profile}", "--chunks", "0"], "chunks must be an integer of at least 1"),
    (["simulate", "{profile}", "--cluster", "moon"], "cluster 'moon' is neither a preset"),
    (["tune", "{profile}", "--memory-budget", "lots"], "cannot read a memory size from 'lots'"),
    (["compare", "nowhere", "nothere"], "no such trace file"),
    (["profile", "--model", "vgg"], "unknown model 'vgg'"),
])
def test_user_mistakes_are_one_line_errors(argv, message, profile_path, capsys):
    argv = [a.replace("{profile}", str(profile_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_run_with_profile_compares(tmp_path, capsys):
    prof_out = tmp_path / "p.csv"
    small = ["--model", "mlp", "--set", "width=16", "--set", "depth=3", "--set", "in_features=8"]
    assert main(["profile", *small, "--sizes", "1,2,4", "--repeats", "1", "--warmup", "0",
                 "--out", str(prof_out)]) == 0
    out = tmp_path / "run"
    assert main(["run", *small, "--balance", "2,2", "--chunks", "4", "--batch-size", "8",
                 "--iterations", "2", "--warmup", "1", "--profile", str(prof_out),
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "measured  iteration" in text and "compare   iteration" in text
    assert (out / "compare.png").exists() and (out / "measured_actions.csv").exists()
    assert main(["compare", str(out), str(out), "--out", str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp" / "compare_actions.csv").exists()


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path, capsys):
    assert main(["demo", "--quick", "--out", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "outputs" in out
    assert (tmp_path / "demo" / "profile.csv").exists()
    assert (tmp_path / "demo" / "simulated_plans.csv").exists()
