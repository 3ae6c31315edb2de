"""Preemption's pieces in one process: the signals and their refusals, the grace each environment advertises, the
grace lines, the agreement without a process group, the hand-over's relay, and the Ray launcher's refusals
(tests/e2e/test_preemption_job.py and test_ray.py launch the real thing)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import pytest

from hfdist.config.preemption import (
    PREEMPTED_EXIT_CODE,
    advertised_grace,
    elastic_env,
    grace_lines,
    preempt_signals,
    signal_name,
)


def test_exit_code_is_distinct_from_success_crash_bad_input_hang_and_death_by_signal():
    from hfdist.train.watchdog import EXIT_CODE as HANG

    assert PREEMPTED_EXIT_CODE == 75  # sysexits.h EX_TEMPFAIL, the code docs/clusters.md names
    assert PREEMPTED_EXIT_CODE not in (0, 1, 2, HANG) and PREEMPTED_EXIT_CODE < 128


def test_signal_names_numbers_and_refusals():
    assert signal_name("usr2") == signal_name("SIGUSR2") == signal_name(str(int(signal.SIGUSR2))) == "SIGUSR2"
    assert preempt_signals() == ("SIGTERM", "SIGUSR1")
    assert preempt_signals("USR2") == ("SIGTERM", "SIGUSR1", "SIGUSR2")
    assert preempt_signals("SIGTERM") == ("SIGTERM", "SIGUSR1")  # already one of them
    with pytest.raises(argparse.ArgumentTypeError, match="cannot be caught"):
        signal_name("KILL")
    with pytest.raises(argparse.ArgumentTypeError, match="not a signal"):
        signal_name("SIGNOPE")


def test_bad_preempt_signal_is_refused_by_the_command_line(capsys):
    from hfdist.config.finetune import parse_args

    with pytest.raises(SystemExit) as stop:
        parse_args(["--preempt-signal", "SIGSTOP"])
    assert stop.value.code == 2 and "--preempt-signal" in capsys.readouterr().err


def test_advertised_grace_by_environment():
    assert advertised_grace({}) is None  # Slurm and Ray advertise none a process can read
    assert advertised_grace({"SLURM_JOB_ID": "7"}) is None
    grace = advertised_grace({"KUBERNETES_SERVICE_HOST": "10.0.0.1"})
    assert grace.seconds == 30 and "terminationGracePeriodSeconds" in grace.source
    assert advertised_grace({"KUBERNETES_SERVICE_HOST": "x", "HFDIST_PREEMPT_GRACE": "90"}).seconds == 90
    # torchrun's wait after forwarding the signal: its flag, its environment variables, else torch's 30 s.
    elastic = {"TORCHELASTIC_RUN_ID": "r"}
    assert advertised_grace(elastic).seconds == 30
    assert advertised_grace({**elastic, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45"}).seconds == 45
    assert advertised_grace(elastic, ["torchrun", "--shutdown-timeout", "120", "x.py"]).seconds == 120
    assert advertised_grace(elastic, ["torchrun", "--shutdown_timeout=12"]).seconds == 12
    # The smallest applies; hfdist's own hand-over waits as long as the ranks need.
    assert advertised_grace({**elastic, "HFDIST_PREEMPT_GRACE": "10"}).source == "HFDIST_PREEMPT_GRACE"
    assert advertised_grace({**elastic, "HFDIST_PREEMPT_GRACE": "100"}).seconds == 30
    assert advertised_grace(elastic, handed_over=True) is None


def test_grace_lines_warn_when_the_checkpoint_does_not_fit():
    grace = advertised_grace({"HFDIST_PREEMPT_GRACE": "30"})
    fits = grace_lines(12.0, 3.0, grace, ("SIGTERM", "SIGUSR1"), "checkpoint-50")
    assert fits == ["hfdist: preemption needs 15.0 s after SIGTERM/SIGUSR1: checkpoint-50 took 12.0 s to write, plus "
                    "up to 3.0 s to end the step in progress; the environment gives 30 s (HFDIST_PREEMPT_GRACE)."]
    late = grace_lines(40.0, None, grace, ("SIGTERM",), "checkpoint-50")
    assert "needs at least 40.0 s" in late[0] and late[1].startswith("hfdist: warning:") and "above 40 s" in late[1]
    assert "printed after the first one" in grace_lines(None, None, None, ("SIGTERM",), "")[0]


def test_the_hand_over_keeps_the_preemption_signals_from_torch_elastic():
    """The hand-over relays them (hfdist.job.signal_relay); the agent handles the rest and waits for the ranks."""
    env = elastic_env(("SIGTERM", "SIGUSR1", "SIGUSR2"), {})
    assert env["PET_SIGNALS_TO_HANDLE"] == "SIGINT,SIGHUP,SIGQUIT"
    assert int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) >= 3600
    assert elastic_env(("SIGTERM",), {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"}).keys() == {
        "PET_SIGNALS_TO_HANDLE"}  # a user's own value wins


def test_the_relay_sends_the_first_signal_once_to_every_child_and_ignores_the_rest(tmp_path):
    """Children that count the SIGUSR1s they get: after three signals to the relaying process each child got one, and
    the relay's handlers stay ignoring (not the default action, which would end the process) after it is left."""
    from hfdist.job.signal_relay import SignalRelay

    counter = ("import signal, sys, time\n"
               "got = []\n"
               "signal.signal(signal.SIGUSR1, lambda *a: got.append(1))\n"
               "print('ready', flush=True)\n"
               "time.sleep(3)\n"
               "print(len(got), flush=True)\n")
    kids = [subprocess.Popen([sys.executable, "-c", counter], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    for kid in kids:
        assert kid.stdout.readline().strip() == "ready"
    before = signal.getsignal(signal.SIGUSR1)
    try:
        with SignalRelay(("SIGUSR1", "SIGUSR2"), targets=lambda: [k.pid for k in kids]) as relay:
            for _ in range(3):
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGUSR2)
        assert relay.received == "SIGUSR1"
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN and signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGUSR1)  # after the relay: still ignored, the test process lives on
        assert [int(k.communicate()[0].strip()) for k in kids] == [1, 1]
    finally:
        signal.signal(signal.SIGUSR1, before)
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)


def test_a_relay_that_saw_no_signal_gives_the_handlers_back():
    from hfdist.job.signal_relay import SignalRelay

    before = signal.getsignal(signal.SIGUSR2)
    with SignalRelay(("SIGUSR2",), targets=list):
        assert signal.getsignal(signal.SIGUSR2) is not before
    assert signal.getsignal(signal.SIGUSR2) is before


def test_a_preempted_rank_ignores_later_notices_once_it_stops_training():
    from hfdist.train.preemption import PreemptionWatch

    before = signal.getsignal(signal.SIGUSR1)
    watch = PreemptionWatch(("SIGUSR1",))
    watch.arm()
    try:
        watch.disarm(preempted=True)
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGUSR1)  # ignored
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_watch_agrees_alone_and_gives_the_signal_back():
    from hfdist.train.preemption import PreemptionWatch

    watch = PreemptionWatch(("SIGUSR1",))
    before = signal.getsignal(signal.SIGUSR1)
    watch.arm()
    try:
        assert watch.agree() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert watch.agree() == ("SIGUSR1", 0)
        assert watch.rank_record()["preempt_signal"] == "SIGUSR1"
    finally:
        watch.disarm()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_hand_over_relays_the_signal_and_exits_75_on_the_ranks_note():
    """The launch command stands in for accelerate: it signals the hand-over twice (as Slurm signals every process of
    a job) and leaves rank 0's note once it has the relayed SIGTERM, which comes once."""
    from hfdist.errors import ERROR_DIR_ENV
    from hfdist.job.launch import _hand_over, _in_a_process

    child = ("import os, signal, sys, time\n"
             "def stop(signum, frame):\n"
             f"    open(os.path.join(os.environ['{ERROR_DIR_ENV}'], 'preempted.txt'), 'w').write('preempted')\n"
             "    sys.exit(143)\n"
             "signal.signal(signal.SIGTERM, stop)\n"
             "os.kill(os.getppid(), signal.SIGTERM)\n"  # as Kubernetes signals the container's first process
             "os.kill(os.getppid(), signal.SIGTERM)\n"
             "time.sleep(60)\n"
             "sys.exit(1)\n")
    before = signal.getsignal(signal.SIGTERM)
    try:
        start = _in_a_process([sys.executable, "-c", child])
        assert _hand_over(start, dict(os.environ), "test", ("SIGTERM",)) == PREEMPTED_EXIT_CODE
        # Ignored from then on: the hand-over is leaving with 75, and a later notice must not make it a kill's 143.
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)


def test_hand_over_reports_a_relayed_signal_that_ended_the_ranks_outside_training(capsys):
    """A rank with the default SIGTERM action (loading, or saving the final model) dies of the relayed signal: no
    note, so the hand-over exits 128 + 15, as docs/clusters.md says, with a line saying no checkpoint was written."""
    from hfdist.job.launch import _hand_over, _in_a_process

    child = ("import os, signal, time\n"
             "os.kill(os.getppid(), signal.SIGTERM)\n"
             "time.sleep(60)\n")
    before = signal.getsignal(signal.SIGTERM)
    try:
        code = _hand_over(_in_a_process([sys.executable, "-c", child]), dict(os.environ), "test", ("SIGTERM",))
    finally:
        signal.signal(signal.SIGTERM, before)
    assert code == 128 + signal.SIGTERM
    assert "got SIGTERM outside training" in capsys.readouterr().err


def test_max_failures_without_ray_is_refused(tmp_path, capsys):
    from hfdist.cli.finetune import MODULE_ENTRY, run_finetune

    code = run_finetune(["--max-failures", "2", "--output-dir", str(tmp_path / "out")], MODULE_ENTRY)
    err = capsys.readouterr().err
    assert code == 2 and "--max-failures" in err and "--launcher ray" in err and "--max-restarts" in err


def test_ray_missing_is_refused_in_one_paragraph(tmp_path, monkeypatch, capsys):
    from hfdist.cli.finetune import MODULE_ENTRY, run_finetune

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    code = run_finetune(["--launcher", "ray", "--output-dir", str(tmp_path / "out")], MODULE_ENTRY)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "pip install 'hfdist[ray]'" in err
    assert not (tmp_path / "out").exists()


def test_unreachable_ray_cluster_is_refused_in_one_paragraph(tmp_path, monkeypatch, capsys):
    from hfdist.cli.finetune import MODULE_ENTRY, run_finetune

    from helpers import free_port

    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{free_port()}")  # nothing listens there
    code = run_finetune(["--launcher", "ray", "--output-dir", str(tmp_path / "out")], MODULE_ENTRY)
    err = capsys.readouterr().err
    assert code == 2 and "cannot reach the Ray cluster at RAY_ADDRESS=127.0.0.1:" in err and "ray start --head" in err


def test_slurm_template_relays_the_notice_and_requeues(tmp_path):
    """scripts/slurm_finetune.sbatch under stand-ins for srun / scontrol: Slurm's notice (SIGUSR1 to the batch shell)
    reaches srun (which forwards it to every task), and once the step has ended the job requeues itself and exits 75."""
    from helpers import REPO

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    (bin_dir / "scontrol").write_text(
        f"#!/bin/bash\nif [ \"$1\" = show ]; then printf 'gpu-a\\n'; else echo \"scontrol $*\" >> {log}; fi\n")
    # srun: tells the test it runs, then waits for the relayed notice (a task that checkpoints and stops).
    (bin_dir / "srun").write_text(
        f"#!/bin/bash\ntrap 'echo \"srun got USR1\" >> {log}; exit 1' USR1\necho started >> {log}\n"
        "while true; do sleep 0.1; done\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-a",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_ID": "77", "SLURM_SUBMIT_DIR": str(REPO)}
    shell = subprocess.Popen(["bash", str(REPO / "scripts" / "slurm_finetune.sbatch"), "--config", "ddp"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not (log.is_file() and "started" in log.read_text()):
        assert shell.poll() is None, shell.communicate()
        time.sleep(0.05)
    shell.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@...` sends
    out, err = shell.communicate(timeout=60)
    assert shell.returncode == PREEMPTED_EXIT_CODE, out + err
    assert log.read_text().splitlines()[1:] == ["srun got USR1", "scontrol requeue 77"]
