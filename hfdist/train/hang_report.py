"""The hang report's logic, apart from its gathering and its actions: `diagnose` (pure: the flight recorder's record
and every rank's last heartbeat in, a `HangDiagnosis` out) and `render` (the paragraph every line of which starts
with "hfdist:", so the console keeps it on the screen). hfdist.train.watchdog gathers the inputs when a collective
times out, acts on the diagnosis (ends silent ranks on its host, removes the unfinished save) and prints the render.

A heartbeat is {"rank", "host", "pid", "time", "phase", "step", "last_enqueued": {group key: seq}, "stack": [...]}
(hfdist.train.watchdog.CollectiveWatch publishes one per rank into the job's store); a flight-recorder record is
torch's (`entries`: the recorded collectives; `pg_status`: per group, the last enqueued and completed sequence
numbers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["HEARTBEAT_SECONDS", "HangDiagnosis", "diagnose", "render", "timed_out_entry"]

HEARTBEAT_SECONDS = 2.0  # how often a rank publishes; one silent for 3 of these is stopped, dead or stuck
_SILENT_AFTER = 3 * HEARTBEAT_SECONDS


@dataclass(frozen=True)
class HangDiagnosis:
    """What a rank that timed out in a collective knows about the hang.

    Attributes:
        rank, world: the reporting rank and the world size.
        where: what the reporting rank was doing ("step 7", or a phase).
        collective: the collective that timed out, as the report names it.
        group: the flight-recorder key of that collective's process group; None when the recorder had no entry.
        waited: how long it waited, against which limit.
        missing: ranks whose last enqueued collective in that group is before it: they never joined.
        silent: ranks whose last heartbeat is older than three heartbeats (stopped, dead or holding the GIL).
        unknown: ranks that never published a heartbeat.
        beats: every rank's last heartbeat (the reporting rank's taken now).
        now: when the diagnosis was made (seconds since the epoch).
    """

    rank: int
    world: int
    where: str
    collective: str
    group: str | None
    waited: str
    missing: list[int] = field(default_factory=list)
    silent: list[int] = field(default_factory=list)
    unknown: list[int] = field(default_factory=list)
    beats: dict[int, dict[str, Any]] = field(default_factory=dict)
    now: float = 0.0

    @property
    def culprits(self) -> list[int]:
        """The ranks the report names as never having joined."""
        return sorted(set(self.missing) | set(self.silent) | set(self.unknown))

    def silent_on(self, host: str) -> list[tuple[int, int]]:
        """(rank, pid) of the silent ranks whose last heartbeat came from `host`."""
        return [(r, int(self.beats[r]["pid"])) for r in self.silent
                if self.beats[r].get("host") == host and self.beats[r].get("pid")]


def timed_out_entry(record: dict[str, Any]) -> dict[str, Any] | None:
    """The flight-recorder entry of the collective this rank is stuck in: in a group whose last enqueued collective
    is past its last completed one, the first not completed (the oldest such, over the groups); else the oldest
    entry not retired. (gloo marks the timed-out work retired once its wait has raised.)"""
    entries = record.get("entries", [])
    stuck = set()
    for group, status in record.get("pg_status", {}).items():
        done = int(status.get("last_completed_collective") or -1)
        if int(status.get("last_enqueued_collective") or -1) > done:
            stuck.add((group, done + 1))
    found = [e for e in entries if ((e.get("process_group") or ["?"])[0], e.get("collective_seq_id")) in stuck
             and not e.get("is_p2p")]
    found = found or [e for e in entries if not e.get("retired")]
    return min(found, key=lambda e: e.get("time_created_ns", 0)) if found else None


def diagnose(record: dict[str, Any], beats: dict[int, dict[str, Any]], *, rank: int, world: int, now: float,
             where: str, limit: str, stall_fraction: float | None = None, unrecorded: str = "a collective",
             timeout_message: str | None = None) -> HangDiagnosis:
    """Who never joined the collective this rank timed out in.

    Args:
        record: this rank's flight-recorder record (with its collectives).
        beats: every rank's last heartbeat the store holds, this rank's included.
        where: what this rank was doing ("step 7", or a phase).
        limit: the timeout in effect, as the report names it ("--collective-timeout 20 s", ...).
        stall_fraction: set when no timeout was raised but the heartbeat found the collective waiting this share of
            the limit (NCCL, before torch's watchdog aborts); None for a raised timeout (gloo).
        unrecorded: how to name the collective when the flight recorder holds no unfinished entry (torch 2.13's gloo
            records only some ops): what this rank's stack says.
        timeout_message: the raised timeout's first line (gloo), quoted then.
    """
    entry = timed_out_entry(record)
    waited = f"waited more than {limit}"
    group, missing = None, []
    if entry is None:
        error = f"; flight recorder: {record['error'][:160]}" if "error" in record else ""
        gloo = f"; gloo: {timeout_message}" if timeout_message else ""
        collective = (f"{unrecorded} (from this rank's stack: the flight recorder holds no unfinished "
                      f"entry{error}{gloo})")
    else:
        group, desc = (entry.get("process_group") or ["?", "?"])[:2]
        seq = int(entry.get("collective_seq_id") or entry.get("p2p_seq_id") or 0)
        collective = f"{entry.get('profiling_name')} #{seq} of process group {group} ({desc or 'unnamed'})"
        missing = sorted(r for r, b in beats.items() if group in b.get("last_enqueued", {})
                         and int(b["last_enqueued"][group] or -1) < seq)
        if stall_fraction is not None:
            age = now - int(entry.get("time_created_ns") or 0) / 1e9
            waited = (f"has waited {age:.0f} s, over {stall_fraction:.0%} of {limit}: reported now, before NCCL's "
                      "watchdog aborts the process")
    silent = sorted(r for r, b in beats.items() if now - b["time"] > _SILENT_AFTER and r != rank)
    return HangDiagnosis(rank=rank, world=world, where=where, collective=collective, group=group, waited=waited,
                         missing=missing, silent=silent, unknown=sorted(set(range(world)) - set(beats)),
                         beats=beats, now=now)


def render(d: HangDiagnosis, killed: list[int], removed: list[str], exit_code: int) -> str:
    """The report: the collective and its wait, who never joined, where every rank was (its last stack), and what
    this rank did about it (`killed`: silent ranks on its host it ended; `removed`: unfinished saves it deleted)."""
    culprits = d.culprits
    lines = [f"hfdist: collective timeout on rank {d.rank} at {d.where}: {d.collective} {d.waited}.",
             f"hfdist: never joined: {_rank_list(culprits) if culprits else 'no rank is known to be missing'}"
             + "".join(f"\nhfdist:   rank {r}: {_state_of(d.beats.get(r), d.now, d.group)}" for r in culprits),
             "hfdist: where each rank was (Python stack of its main thread: its last heartbeat's, this rank's now):"]
    for rank in range(d.world):
        beat = d.beats.get(rank)
        lines.append(f"hfdist: -- rank {rank}: {_state_of(beat, d.now, d.group)}")
        lines += [f"hfdist:    {ln}" for frame in (beat or {}).get("stack", []) for ln in frame.splitlines()]
    if removed:
        lines.append(f"hfdist: removed the unfinished save {', '.join(removed)} (never resumed from).")
    if killed:
        lines.append(f"hfdist: {_rank_list(killed)} on this host, silent, killed (SIGKILL) so that the job ends now "
                     "(a stopped process ignores the launcher's SIGTERM, which then waits 30 s before SIGKILL).")
    lines.append(f"hfdist: the job stops (exit code {exit_code}); checkpoints already complete are intact (resume "
                 "with --resume). A rank that never joins is stopped, dead, or stuck outside a collective: see its "
                 "stack above and its log in logs/.")
    return "\n".join(lines)


def _rank_list(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _state_of(beat: dict[str, Any] | None, now: float, group: str | None) -> str:
    if beat is None:
        return "never published a heartbeat (it did not reach training, or its store connection failed)"
    where = f"step {beat['step']}" if beat.get("step") is not None else beat.get("phase", "?")
    age = now - beat["time"]
    alive = f"alive ({age:.0f} s ago)" if age <= _SILENT_AFTER else \
        f"silent for {age:.0f} s (stopped, dead, or holding the GIL)"
    last = (beat.get("last_enqueued") or {}).get(group) if group is not None else None
    return f"{where}, heartbeat {alive}" + (f", its last collective in that group #{last}" if last is not None else "")
