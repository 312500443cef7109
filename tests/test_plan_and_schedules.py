"""Plans and schedules: validation, orders, dependencies, text and CSV forms."""

from __future__ import annotations

import pytest

from pipesim import PlanError, ScheduleError
from pipesim.balance import block_partition, even_balance, min_max_partition
from pipesim.plan import Plan
from pipesim.schedule import Action, Schedule, build_schedule, dependencies, program


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(balance=[2, 0, 2]), r"non-positive entries \[0\]"),
    (dict(balance=[2, -1]), r"non-positive entries \[-1\]"),
    (dict(chunks=0), "chunks must be an integer of at least 1, got 0"),
    (dict(chunks=9, batch_size=8), "chunks 9 is larger than the batch size 8"),
    (dict(checkpoint="sometimes"), "unknown checkpoint mode 'sometimes'"),
    (dict(placement=[0, 2]), r"leaves device\(s\) \[1\] without a stage"),
])
def test_invalid_plans_name_the_value(kwargs, message):
    base = dict(balance=[2, 2], chunks=4, batch_size=8)
    with pytest.raises(PlanError, match=message):
        Plan(**{**base, **kwargs})


def test_balance_must_cover_the_model():
    with pytest.raises(PlanError, match=r"balance \[2, 2\] sums to 4 layers but the model has 5"):
        Plan([2, 2], 2, 4).check_layers(5)


def test_unknown_schedule():
    with pytest.raises(PlanError, match="unknown schedule 'zigzag'"):
        build_schedule(Plan([1, 1], 2, 4, schedule="zigzag"))


def test_more_stages_than_layers():
    with pytest.raises(PlanError, match="3 stages is more than the 2 layers"):
        even_balance(2, 3)


def test_interleaved_needs_multiple_of_devices():
    with pytest.raises(PlanError, match=r"micro-batches \(3\) to be a multiple of the 2 devices"):
        build_schedule(Plan([1] * 4, 3, 3, schedule="interleaved", virtual_stages=2))


def test_checkpoint_modes_follow_torchgpipe():
    for mode, expected in [("always", [True] * 4), ("except_last", [True, True, True, False]),
                           ("never", [False] * 4)]:
        plan = Plan([1, 1], 4, 8, checkpoint=mode)
        assert [plan.checkpointed(m) for m in range(4)] == expected


def test_uneven_batch_makes_fewer_micro_batches():
    plan = Plan([1, 1], 4, 5)
    assert plan.micro_batch_sizes == (2, 2, 1)
    assert build_schedule(plan).n_microbatches == 3


def test_gpipe_order_is_clock_cycles_then_reverse():
    s = build_schedule(Plan([1, 1, 1], 3, 3))
    assert [str(a) for a in s.order[1]] == ["1F0", "1F1", "1F2", "1B2", "1B1", "1B0"]


def test_1f1b_limits_warmup_to_remaining_stages():
    s = build_schedule(Plan([1] * 4, 6, 6, schedule="1f1b"))
    assert " ".join(map(str, s.order[0][:6])) == "0F0 0F1 0F2 0F3 0B0 0F4"
    assert " ".join(map(str, s.order[3][:4])) == "3F0 3B0 3F1 3B1"


def test_interleaved_places_stages_round_robin():
    s = build_schedule(Plan([1] * 6, 4, 4, schedule="interleaved", virtual_stages=3))
    assert s.placement == (0, 1, 0, 1, 0, 1)
    assert {a.stage for a in s.order[1]} == {1, 3, 5}


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
@pytest.mark.parametrize("m", [4, 8])
def test_orders_obey_dependencies(schedule, v, m):
    s = build_schedule(Plan([1] * (4 * v), m, 16, schedule=schedule, virtual_stages=v))
    position = {a: i for device in s.order for i, a in enumerate(device)}
    for device in s.order:
        for a in device:
            for dep in dependencies(a, s.n_stages):
                if s.placement[dep.stage] == s.placement[a.stage]:
                    assert position[dep] < position[a], f"{dep} must precede {a}"


def test_deadlock_names_the_stuck_actions():
    order = [[Action(0, "F", 0), Action(0, "B", 0)], [Action(1, "B", 0), Action(1, "F", 0)]]
    with pytest.raises(ScheduleError, match=r"deadlocks: .*device 1 at 1B0 waits for 1F0"):
        Schedule.from_order(order)


def test_incomplete_and_misplaced_actions():
    with pytest.raises(ScheduleError, match=r"incomplete \(1 problem\(s\)\): 0B0 \(or its I and W\)"):
        Schedule.from_order([[Action(0, "F", 0)]])
    with pytest.raises(ScheduleError, match=r"0W0 missing"):
        Schedule.from_order([[Action(0, "F", 0), Action(0, "I", 0)]])
    with pytest.raises(ScheduleError, match=r"both B and a split backward"):
        Schedule.from_order([[Action(0, "F", 0), Action(0, "B", 0), Action(0, "W", 0)]])
    with pytest.raises(ScheduleError, match=r"appears twice"):
        Schedule.from_order([[Action(0, "F", 0), Action(0, "F", 0), Action(0, "B", 0)]])


def test_plans_that_run_the_same_actions_have_one_program():
    # at one micro-batch GPipe and 1F1B run F then B on every device, and except_last
    # checkpoints nothing: four names, one program
    names = [Plan([3, 3], 1, 8, checkpoint=c, schedule=s)
             for s in ("gpipe", "1f1b") for c in ("never", "except_last")]
    assert len({program(p) for p in names}) == 1
    one = program(names[0])
    # anything that changes an action, its order, its size or its stage's layers does not
    for other in (Plan([3, 3], 1, 8, checkpoint="always"), Plan([3, 3], 2, 8, checkpoint="never"),
                  Plan([3, 3], 1, 6, checkpoint="never"), Plan([2, 4], 1, 8, checkpoint="never"),
                  Plan([3, 3], 1, 8, checkpoint="never", placement=[1, 0]),
                  Plan([3, 3], 1, 8, checkpoint="never", optimizer="adam")):
        assert program(other) != one, other.label()
    # two micro-batches: 1F1B's last stage alternates, GPipe's does not
    assert (program(Plan([3, 3], 2, 8, checkpoint="never", schedule="1f1b"))
            != program(Plan([3, 3], 2, 8, checkpoint="never", schedule="gpipe")))


def test_action_text_form():
    assert str(Action(1, "F", 0)) == "1F0"
    assert Action.parse("12B3") == Action(12, "B", 3)
    with pytest.raises(ScheduleError, match="'1X0' is not an action"):
        Action.parse("1X0")


def test_csv_round_trip(tmp_path):
    s = build_schedule(Plan([1] * 4, 4, 4, schedule="interleaved", virtual_stages=2))
    back = Schedule.from_csv(s.to_csv(tmp_path / "sched.csv"))
    assert back.order == s.order and back.placement == s.placement


def test_csv_bad_cell_names_row_and_column(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0B0\n1F0,oops,1B0\n")
    with pytest.raises(ScheduleError, match=r"bad\.csv: row 2, column 2: 'oops' is not an action"):
        Schedule.from_csv(path)


@pytest.mark.parametrize(("schedule", "v"), [("1f1b", 1), ("zbv", 2)])
def test_csv_is_readable_by_torch_pipelining(tmp_path, schedule, v):
    torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    s = build_schedule(Plan([1] * (2 * v), 3, 3, schedule=schedule, virtual_stages=v))
    import csv

    with s.to_csv(tmp_path / "s.csv").open() as f:
        rows = [[torch_schedules._Action.from_str(c) for c in row] for row in csv.reader(f)]
    for d in range(2):
        assert [str(a) for a in rows[d]] == [str(a) for a in s.order[d]]


def test_min_max_partition_is_optimal_and_block_is_close():
    costs = [1, 1, 1, 10, 1, 1, 1, 1]
    best = min_max_partition(costs, 3)
    assert max(sum(costs[a:b]) for a, b in _spans(best)) == 10
    assert sum(block_partition(costs, 3)) == len(costs)
    # exhaustive check on a small case
    import itertools

    costs = [3, 1, 4, 1, 5, 9, 2, 6]
    best_cost = min(max(sum(costs[a:b]) for a, b in _spans(list(bal)))
                    for bal in itertools.product(range(1, 7), repeat=3) if sum(bal) == 8)
    assert max(sum(costs[a:b]) for a, b in _spans(min_max_partition(costs, 3))) == best_cost


def _spans(balance):
    start = 0
    for b in balance:
        yield start, start + b
        start += b
