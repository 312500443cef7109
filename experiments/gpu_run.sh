#!/usr/bin/env bash
# The device commands, rerunnable on any machine with a CUDA GPU and 16 cores.
# The lent GPU machine has torch but no simpy: a wheel in .whl/ is installed first if present.
#   bash experiments/gpu_run.sh tests           # the in-process gradient tests on cuda:0
#   bash experiments/gpu_run.sh gpu [--stages 2]  # CUDA profiles + executor grid on cuda:0
#   bash experiments/gpu_run.sh cpu16 [--models mlp,gpt]  # 4 and 8 pinned processes
#       (CPU16_STAGES="4" for the 4-process grid alone; validate.py's options follow, e.g.
#       --passes 1 --tie-break 0 to fit a 10-minute call)
#   bash experiments/gpu_run.sh bench           # in-process executor vs the unpipelined model
#   bash experiments/gpu_run.sh threads         # two stage threads: F and B alone vs overlapped
#   bash experiments/gpu_run.sh crossing        # two pinned ranks sending to each other at once
#   bash experiments/gpu_run.sh console         # the console's GPU path end to end (about
#       a minute): profile --streams 2, calibrate --transport threads with each stage of
#       [5,5] in place, run one plan against its prediction (results/gpu/console/)
#   bash experiments/gpu_run.sh switch [--model gpt]  # the 2-sample plans under GIL switch
#       intervals 0.5 / 5 / 50 ms, and with every thread of the process on one core
#       (experiments/switch_interval.py: is their loss the interpreter's hand-over, or its
#       crossing cores? on the 2-core VM one core took the small gpt's 0.61-0.86x as long;
#       about a minute and a half a model)
# On the lent machine (10 minutes a call, 15 of device time a session, a start included;
# each command under `timeout`), one grid a session, in this order (2026-11-26: the H200
# fp32 grid is done, results/gpu/h200-2026-11-26-grid/; 2026-11-27: switch, console and the
# 4-rank mlp grid with idle costs are done, results/gpu/h200-2026-11-27/; that evening the
# same grid with the receives posted once inputs are in and --min-seconds 1, 435 s,
# results/gpu/h200-2026-11-27-evening/: a gpt call after it got only 326 s of the
# session's 15 minutes and wrote nothing -- a second call needs some 400 s left; next,
# gpu --models gpt into a folder of its own (its profiles time the pairs), re-predicted
# afterwards by `python experiments/repredict_evidence.py --grid FOLDER`; then cpu16 with
# each plan timed longer -- since 2026-11-27 its ranks post their next receives once an
# action's inputs are in (executor.stage.StageRunner._inputs_in), so its GPipe plans'
# messages no longer stall behind those posts; compare with the 11-26/11-27 cpu16 grids'
# saved actions by experiments.phase_errors.message_transits -- then threads with tests):
#   CPU16_STAGES=4 cpu16 --models mlp --tag mlp --passes 1 --tie-break 0 --lean
#           --min-seconds 1 alone in one call under `timeout 560` (2026-11-27 at the
#           default 0.25 s a plan: 386 s, 48 of them the grid, and a noise floor of 8.1%
#           that the 8.45% median error sat on; 1 s a plan, about a minute more), then gpt
#           alike (--lean: no ablation-only readings
#           nor confirmed choice, a fifth or so less: 308 -> about 240 s for a quick
#           4-rank mlp grid on the 2-core VM) (2026-11-26 without idle costs: both
#           models' 4-rank grid in 7 minutes on the H200 host, 8.1% / 32.5%; with idle
#           costs at once, mlp alone was still in its after-grid readings at 345 s and
#           was cut: h200-2026-11-26/README.md; since then the idle costs take about half
#           the steps, 3 sizes after 3 idles), then CPU16_STAGES=8 (its mlp quick grid
#           alone took 4 minutes without idle costs);
#   gpu --stages 2 --dtypes float32 --no-stage-memory --out experiments/results/gpu/NEW-FOLDER
#           under `timeout 560` (its profiles now also time each pass beside each other
#           pass, 16 pairs a size, for the variant threads_pairs: some 30-60 s a model
#           more; where a call is short, `--models gpt` and `--models mlp`, one call
#           and one --out folder each: a run starts its folder's grid files afresh;
#           mlp's profile's B|B pair says whether a plain backward holds autograd's
#           thread for its host columns, which the traces' never plans deny and the
#           grids' want: repredict_evidence.py's threads_no_bwd_hold, session 45)
#           (2026-11-26 on an H200: 540 s with the stage memory, 80 s
#           of it, and before the in-place costs, about 40-80 s more; a folder of its
#           own: the default one holds the 2026-11-23 H100
#           run that repredict_evidence.py reads; gpt fp32's profile alone, interpreter
#           shares included, took 3 minutes on 2026-11-26; the grid also predicts every
#           plan as threads of one process; its allocator snapshots check the
#           reserved-memory estimate: python experiments/reserved_evidence.py afterwards);
#           (it measures each stage of the grid in place before the grid: about 40 s
#           for gpt + mlp fp32 on the H200; `gpu --in-place-only --out DIR` alone for a
#           grid already in DIR);
#   tests (about a minute);
#   threads (two stage threads of a launch-bound GPT: each kind of action beside each
#           other kind, the pairs the H200 grid's 2-sample plans need: see
#           experiments/README.md, "Measured on an H200"), gpu --stage-memory-only
#           --stages 2 (the profiles the grid left), crossing;
# Checked on the 2-core VM without a GPU (2026-12-01, after the executor changes since the
# last lent machine): `python experiments/gpu_validate.py --device cpu --quick --dtypes
# float32 --stages 2 --iterations 2 --min-seconds 0.05 --in-place-rounds 2 --out /tmp/gq`
# runs to the end (2.6 min), as do thread_interpreter.py --device cpu, switch_interval.py
# --device cpu --small, bench_executor_cuda.py --device cpu --quick, crossing_messages.py
# and the console chain with --device cpu: a lent machine's minutes go to measuring.
# carry .whl (simpy: pip download --no-deps -d .whl simpy==4.1.2, .whl ignored in
# .git/info/exclude) and the results of earlier calls, committed, travel with the tree.
# Results go to experiments/results/gpu/ as each grid finishes (a run cut short keeps them),
# the console log beside them (run_WHAT.log). With $OUT set (the lent machine), the folder
# is also packed into $OUT/gpu_results.tgz when the command ends, stopped or not: give the
# whole command a `timeout` shorter than the machine's limit so that the packing happens.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import simpy" 2>/dev/null && ls .whl/simpy-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
RESULTS=experiments/results/gpu
mkdir -p "$RESULTS"
pack() { if [ -n "${OUT:-}" ]; then tar czf "$OUT/gpu_results.tgz" -C experiments/results gpu; fi; }
what="${1:-gpu}"
shift || true
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0) \
    if torch.cuda.is_available() else 'no CUDA')" | tee -a "$RESULTS/device_$what.txt"
run() {
    case "$what" in
        tests) PIPESIM_TEST_DEVICE=cuda:0 python3 -m pytest -q -p no:cacheprovider \
                   tests/test_executor.py -k threads_gradients "$@" ;;
        gpu)   python3 experiments/gpu_validate.py --out "$RESULTS" "$@" ;;
        bench) python3 experiments/bench_executor_cuda.py "$@" ;;
        threads) python3 experiments/thread_interpreter.py --device cuda:0 "$@" ;;
        crossing) python3 experiments/crossing_messages.py --subdir gpu "$@" ;;
        switch) python3 experiments/switch_interval.py --device cuda:0 --placements free,one_core "$@" ;;
        console) gpt=(--model gpt --set vocab=8192 --set d_model=1024 --set n_layers=8
                      --set n_heads=16 --set seq_len=256)
                 c="$RESULTS/console"
                 python3 -m executor.cli profile "${gpt[@]}" --device cuda --sizes 2,4,8,16,32 \
                     --streams 2 --out "$c/profile.csv" &&
                 python3 -m executor.cli calibrate --transport threads --device cuda "${gpt[@]}" \
                     --stage-costs "$c/profile.csv" --balance 5,5 --out "$c/cluster.json" &&
                 python3 -m executor.cli run --transport threads --device cuda "${gpt[@]}" \
                     --balance 5,5 --chunks 16 --checkpoint always --schedule 1f1b \
                     --profile "$c/profile.csv" --cluster "$c/cluster.json" --out "$c/run" "$@" ;;
        # (each plan's GPipe and 1F1B one after the other, --order paired: on 2026-11-27
        # evening the host ran the grid's GPipe block 1.2-1.4x slower, every action alike,
        # and a grid in its built order reads that as GPipe's bias;
        # idle costs measured on every rank at once: one rank at a time they would take
        # 4-8x; without them, 2026-11-26, the 4-rank grid read 8.1% / 32.5%, all under, its
        # actions after 3-30 ms idle 1.2-1.4x their profile)
        # (two passes and the two end profiles, as before validate.py's four passes with
        # profiles between them, 2026-11-29: a lent machine's call is 10 minutes; options
        # given after override these)
        cpu16) for n in ${CPU16_STAGES:-4 8}; do
                   python3 experiments/validate.py --stages "$n" --pin --subdir gpu --iterations 3 \
                       --idle-at-once --order paired --passes 2 --no-profile-between "$@"
               done ;;
        *)     echo "gpu_run.sh: unknown command '$what' (tests, gpu, bench, threads, crossing, switch, console or cpu16)" >&2; return 2 ;;
    esac
}
# The work runs in the background and this shell waits for it, so that a `timeout` (TERM)
# reaches the trap at once: it stops the work, then packs what the finished grids wrote.
set -m  # the work in its own process group, so that the trap can stop all of it
run "$@" > >(tee -a "$RESULTS/run_$what.log") 2>&1 &
job=$!
trap 'kill -- -$job 2>/dev/null || kill $job 2>/dev/null; pack; exit 143' TERM INT
wait $job
status=$?
pack
exit $status
