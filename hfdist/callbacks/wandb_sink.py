"""WandbSink: one W&B run per strategy run, written by the logging rank only, that can never stop training
(hfdist.callbacks.tracker: the first failure warns once and turns W&B off).

It logs what the Trainer logs (hfdist.callbacks.tracker_logs feeds it each `on_log`, the dict every report_to
integration gets); when the Trainer already reports to W&B itself, the sink opens no second run: it leaves the
per-step logging to the Trainer's and puts its summary values and tables into that run.

Runs are offline unless the user is logged in or sets WANDB_MODE, so a job on a machine without W&B access still
leaves a run folder that `wandb sync` uploads later.
"""

from __future__ import annotations

import netrc
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence
from urllib.parse import urlsplit

from hfdist.callbacks.tracker import TrackerSink

__all__ = ["WandbSink", "resolve_wandb_mode", "sync_instructions"]

_DEFAULT_PROJECT = "hfdist"
_DEFAULT_BASE_URL = "https://api.wandb.ai"


def _netrc_has_key(env: Mapping[str, str]) -> bool:
    """Whether `wandb login` stored a key for the W&B host (the netrc file wandb itself reads)."""
    if env.get("NETRC"):
        path = Path(env["NETRC"]).expanduser()
    else:
        unix, windows = Path("~/.netrc").expanduser(), Path("~/_netrc").expanduser()
        path = unix if unix.exists() or not windows.exists() else windows
    host = urlsplit(env.get("WANDB_BASE_URL") or _DEFAULT_BASE_URL).netloc
    try:
        creds = netrc.netrc(str(path)).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(creds and creds[2])


def resolve_wandb_mode(environ: Mapping[str, str] | None = None) -> str:
    """W&B mode for a run: an explicit WANDB_MODE wins; else online when a key is set (WANDB_API_KEY, an
    identity token file, or `wandb login`'s netrc entry for WANDB_BASE_URL); else offline.

    Offline by default because an online init without credentials would prompt for a key or fail.
    """
    env = os.environ if environ is None else environ
    if env.get("WANDB_MODE"):
        return env["WANDB_MODE"]
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE") or _netrc_has_key(env):
        return "online"
    return "offline"


class WandbSink(TrackerSink):
    """The W&B run of one strategy run. On ranks that don't log (`active=False`) every method is a no-op.

    The run starts at the first log/set_summary/log_table call, so a job refused before training leaves no
    empty run. Files go to `<output_dir>/wandb/`.

    Args:
        output_dir: the run's output folder (W&B's `dir`).
        active: whether this rank logs: rank 0, or under PP a rank of the last stage.
        name: run name, the strategy (rung) name.
        group: comparison id shared by the runs to compare (one `hfdist compare` invocation).
        job_type: strategy kind (ddp, fsdp, zero, tp, pp, 3d); defaults to `name`.
        config: the strategy dims and run settings, shown as the run's config.
        project: W&B project; default WANDB_PROJECT, else "hfdist".
        mode: online / offline / disabled; default resolve_wandb_mode().
        init_timeout: seconds wandb.init may take (an unreachable server or a rejected key costs this once, then
            the run is logged offline).
    """

    label = "W&B"

    def __init__(self, *, output_dir: str | os.PathLike, active: bool, name: str, group: str | None = None,
                 job_type: str | None = None, config: Mapping[str, Any] | None = None, project: str | None = None,
                 tags: Sequence[str] = (), mode: str | None = None, init_timeout: float = 60.0) -> None:
        super().__init__(active=active)
        self.mode = (mode or resolve_wandb_mode()) if active else "disabled"
        self._output_dir = Path(output_dir)
        self._init_kwargs = dict(project=project or os.environ.get("WANDB_PROJECT") or _DEFAULT_PROJECT,
                                 name=name, group=group, job_type=job_type or name, config=dict(config or {}),
                                 tags=list(tags), mode=self.mode)
        self._init_timeout = init_timeout
        self.borrowed = False  # the run is the Trainer's own (report_to="wandb"), not one this sink opened

    @property
    def project(self) -> str:
        """The W&B project the run goes to."""
        return self._init_kwargs["project"]

    @property
    def run_dir(self) -> Path | None:
        """The run's local folder (`.../wandb/offline-run-*` offline), once started; None otherwise."""
        if self._run is None or self.mode == "disabled":
            return None
        return Path(self._run.settings.sync_dir)

    @property
    def location(self) -> str | None:
        return str(self.run_dir) if self.run_dir is not None else None

    def record(self) -> dict[str, Any]:
        return {"mode": self.mode, "run_dir": self.location, "error": self.error}

    def _start(self) -> Any:
        import wandb

        self._output_dir.mkdir(parents=True, exist_ok=True)
        # create_new: several sinks in one process (tests, an in-process comparison) must not share a run.
        # silent: no banner and no run history on the console; hfdist's closing lines say where the run is.
        return wandb.init(dir=str(self._output_dir), reinit="create_new",
                          settings=wandb.Settings(init_timeout=self._init_timeout, silent=True), **self._init_kwargs)

    @staticmethod
    def _current_run() -> Any:
        import wandb

        if wandb.run is None:
            raise RuntimeError("the Trainer reports to W&B but has no open run")
        return wandb.run

    def borrow_current_run(self) -> None:
        """Use the run the Trainer's own W&B integration opened instead of opening one: `log` does nothing (the
        Trainer logs the same logs), summary values and tables go into that run, `finish` leaves it open."""
        if not self._closed and self._run is None:
            self.borrowed = True

    def _start_online_or_offline(self) -> Any:
        try:
            return self._start()
        except Exception as exc:
            if self.mode != "online":
                raise
            # Unreachable server or rejected key: keep the run on disk instead, to `wandb sync` later.
            first_line = (str(exc).strip().splitlines() or [""])[0]
            self.error = f"W&B online init failed ({type(exc).__name__}: {first_line}); logged offline instead"
            self.mode = self._init_kwargs["mode"] = "offline"
            run = self._start()
            print(f"hfdist: warning: {self.error} in {run.settings.sync_dir}; upload it with `wandb sync` once "
                  "W&B is reachable.", file=sys.stderr, flush=True)
            return run

    def _open(self) -> Any:
        return self._current_run() if self.borrowed else self._start_online_or_offline()

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log one step's metrics (the Trainer's logs: loss, `rank{r}/...` series and their aggregates, ...)."""
        run = None if self.borrowed else self._ensure_run()
        if run is not None:
            self._call("log", run.log, dict(metrics), step=step)

    def set_summary(self, values: Mapping[str, Any]) -> None:
        """Set run-level figures (peaks, totals) shown in the runs table and compared across runs."""
        run = self._ensure_run()
        if run is not None:
            self._call("summary", run.summary.update, dict(values))

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                  step: int | None = None) -> None:
        """Log a table (e.g. the strategy comparison matrix) under `name`."""
        run = self._ensure_run()
        if run is None:
            return
        import wandb

        table = self._call("table", wandb.Table, columns=list(columns), data=[list(r) for r in rows])
        if table is not None:
            self._call("log", run.log, {name: table}, step=step)

    def finish(self, exit_code: int = 0) -> None:
        """Close the run (flushes it to disk offline, uploads online); later calls do nothing."""
        run, self._run = self._run, None
        self._closed = True
        if run is not None and not self.borrowed:
            self._call("finish", run.finish, exit_code=exit_code)


def sync_instructions(run_dirs: Iterable[str | os.PathLike], project: str | None = None,
                      group: str | None = None) -> str:
    """How to get offline runs into W&B and compare them (W&B reports need a server, none exists offline)."""
    dirs = " ".join(str(d) for d in run_dirs)
    project = project or os.environ.get("WANDB_PROJECT") or _DEFAULT_PROJECT
    where = f"group '{group}'" if group else "the runs"
    return (f"W&B runs were written offline. To upload them (after `wandb login` once):\n"
            f"  wandb sync --project {project} {dirs}\n"
            f"Then, in project '{project}', group by Group to compare {where}; for a report, run\n"
            f"  python -c \"from hfdist.report.wandb_report import build_comparison_report as b; "
            f"print(b('{project}', '{group}'))\"")
