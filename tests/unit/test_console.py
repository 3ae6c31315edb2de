"""The console: hfdist's lines, progress bars and tracebacks on the screen, library chatter in the log file; rank
error paragraphs collected once by the hand-over."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap

from hfdist.config.finetune import ConfigError
from hfdist.console import _DeferredLog, _Router
from hfdist.errors import ERROR_DIR_ENV, collected_errors, run_with_clear_errors


def _route(*writes: str, verbose: bool = False) -> tuple[str, str]:
    screen, log = io.StringIO(), io.StringIO()
    router = _Router(screen, log, verbose)
    for text in writes:
        router.write(text)
    return screen.getvalue(), log.getvalue()


def test_router_sends_hfdist_lines_to_both_and_chatter_to_the_log():
    screen, log = _route("hfdist: starting 2 processes\n", "[WARNING] Setting accelerator to CPU.\n",
                         "hfdist: error: bad input\n\nthe planner's table\n", "wandb: Run history:\n")
    assert screen == "hfdist: starting 2 processes\nhfdist: error: bad input\n\nthe planner's table\n"
    assert log == ("hfdist: starting 2 processes\n[WARNING] Setting accelerator to CPU.\n"
                   "hfdist: error: bad input\n\nthe planner's table\nwandb: Run history:\n")


def test_router_keeps_a_print_together_and_bars_on_screen():
    # print() writes the text and its end separately; a line's first write decides where all of it goes
    screen, log = _route("hfdist: done", "\n", "library note", "\n", "\r 50%|#####", "\r100%|##########", "\n")
    assert screen == "hfdist: done\n\r 50%|#####\r100%|##########\n"
    assert log == "hfdist: done\nlibrary note\n"  # bar redraws (and the newline closing the bar) stay out
    screen, _ = _route("library note\n", verbose=True)
    assert screen == "library note\n"
    # a warning from another thread while the bar's line is open goes to the log, not onto the bar's line
    screen, log = _route("\r 50%|#####", "x.py:83: FutureWarning: old\n  return func()\n", "\r100%|##########", "\n")
    assert screen == "\r 50%|#####\r100%|##########\n" and log == "x.py:83: FutureWarning: old\n  return func()\n"


def test_the_log_waits_for_the_output_folder(tmp_path):
    """A run stopped by bad input before it wrote anything leaves no folder behind; once the run has made its
    folder, what waited is written first."""
    log = _DeferredLog(tmp_path / "out" / "logs" / "rank-0.log")
    log.write("before the folder\n")
    assert not (tmp_path / "out").exists()
    (tmp_path / "out").mkdir()
    log.write("after\n")
    log.flush()
    assert (tmp_path / "out" / "logs" / "rank-0.log").read_text() == "before the folder\nafter\n"
    crash = _DeferredLog(tmp_path / "crashed" / "logs" / "rank-0.log")
    crash.write("chatter\n")
    crash.materialise()  # what an uncaught exception does
    assert (tmp_path / "crashed" / "logs" / "rank-0.log").read_text() == "chatter\n"


_SCRIPT = """
import logging, sys, warnings
from hfdist import console
console.start(sys.argv[1], verbose=False)
logging.getLogger("transformers").warning("The tokenizer has new PAD/BOS/EOS tokens")
warnings.warn("old API", FutureWarning)
print("[INFO] Running in WANDB offline mode")
print("hfdist: a line for the person")
raise RuntimeError("a real failure")
"""


def test_a_process_shows_its_own_lines_and_failures_and_logs_the_rest(tmp_path):
    log = tmp_path / "logs" / "rank-0.log"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_SCRIPT), str(log)], capture_output=True, text=True)
    screen = proc.stdout + proc.stderr
    assert proc.returncode == 1
    assert "hfdist: a line for the person" in proc.stdout
    assert "RuntimeError: a real failure" in proc.stderr and "Traceback" in proc.stderr
    for chatter in ("PAD/BOS/EOS", "FutureWarning", "WANDB offline"):
        assert chatter not in screen and chatter in log.read_text()
    assert "hfdist: a line for the person" in log.read_text() and "RuntimeError" in log.read_text()


def test_ranks_leave_their_paragraph_for_the_hand_over(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
    for rank in ("0", "1", "2", "3"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "4")
        message = "bad dataset columns" if rank != "2" else "rank 2 saw something else"

        def job(message=message):
            raise ConfigError(message)

        assert run_with_clear_errors(job) == 2
    assert capsys.readouterr().err == ""  # the hand-over prints them, once
    assert collected_errors(tmp_path) == ["hfdist: error (ranks 0, 1, 3): bad dataset columns",
                                          "hfdist: error (rank 2): rank 2 saw something else"]
    monkeypatch.delenv(ERROR_DIR_ENV)
    assert run_with_clear_errors(lambda: (_ for _ in ()).throw(ConfigError("x"))) == 2
    assert "hfdist: error (rank 3): x" in capsys.readouterr().err
