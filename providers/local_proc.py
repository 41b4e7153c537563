"""Process plumbing for the local provider: Linux /proc reads, process-group kills, health probes.

A pid alone does not name a process for long: pids are recycled. Local replicas are therefore named by
(pid, start time in clock ticks since boot), field 22 of /proc/PID/stat, which no recycled pid can
share with the original. Zombies (exited, not yet reaped) count as dead.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

_PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class ProcStat:
    pid: int
    state: str  # R, S, D, Z, ...
    pgid: int
    start_ticks: int


def proc_stat(pid: int) -> ProcStat | None:
    """/proc/PID/stat of a process, or None when there is no such process."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) sits in parentheses and may itself hold spaces or ')': split after the last ')'.
    rest = text[text.rindex(")") + 2:].split()
    return ProcStat(pid=pid, state=rest[0], pgid=int(rest[2]), start_ticks=int(rest[19]))


def is_alive(pid: int, start_ticks: int) -> bool:
    """True while the process `pid` that started at `start_ticks` runs (not a zombie, not a recycled pid)."""
    stat = proc_stat(pid)
    return stat is not None and stat.start_ticks == start_ticks and stat.state not in ("Z", "X")


def group_members(pgid: int, not_before_ticks: int = 0) -> list[int]:
    """Live processes of process group `pgid` that started at or after `not_before_ticks`. Older processes
    cannot belong to the group we started, so the bound keeps an unrelated group with a reused id safe."""
    members = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        stat = proc_stat(int(entry.name))
        if stat is not None and stat.pgid == pgid and stat.start_ticks >= not_before_ticks \
                and stat.state not in ("Z", "X"):
            members.append(stat.pid)
    return members


def our_group(pgid: int, leader_start_ticks: int) -> list[int]:
    """Live members of the process group we started as `pgid`, its leader having started at
    `leader_start_ticks`; the leader itself is included while it lives.

    Safe after the leader died: while any member of a group lives, Linux does not hand its id out as a
    new pid, so if a process now holds pid `pgid` with another start time, our group is empty and that
    process (and its group) is someone else's: the answer is []. Processes older than our leader cannot
    be ours either and are left out."""
    leader = proc_stat(pgid)
    if leader is not None and leader.start_ticks != leader_start_ticks:
        return []
    return group_members(pgid, leader_start_ticks)


def signal_group(pgid: int, sig: int, leader_start_ticks: int) -> int:
    """Send `sig` to every process of `our_group(pgid, leader_start_ticks)`; returns how many got it.
    Members are signalled one by one rather than with killpg, which could not skip strangers."""
    count = 0
    for pid in our_group(pgid, leader_start_ticks):
        try:
            os.kill(pid, sig)
            count += 1
        except ProcessLookupError:
            pass
    return count


def reap(pid: int, start_ticks: int) -> None:
    """Collect the exit status of `pid` if it is an exited child of this process (a provider instance
    may adopt a replica that an earlier instance in the same process started), so no zombie is left.
    Only the process that started at `start_ticks`: never another child that reuses the pid."""
    stat = proc_stat(pid)
    if stat is None or stat.start_ticks != start_ticks:
        return
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child: its own parent (or init) reaps it


def describe_exit(returncode: int | None) -> str:
    """'exited with code 1', 'killed by SIGKILL', or 'exited' when the code is not known (not our child)."""
    if returncode is None:
        return "exited"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def log_tail(path: Path, lines: int = 15, max_chars: int = 2000) -> str:
    """The last `lines` lines of a log file (at most `max_chars`), "" when there is none."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 16 * max_chars))
            text = handle.read().decode(errors="replace")
    except OSError:
        return ""
    tail = "\n".join(text.rstrip().splitlines()[-lines:])
    return tail[-max_chars:]


def free_port(host: str) -> int:
    """A TCP port on `host` that nothing listens on right now (another process may take it before us;
    the engine then fails to listen and its replica is reported FAILED with that reason)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


async def http_status(host: str, port: int, path: str = "/health", timeout_s: float = 0.5) -> int | None:
    """The HTTP status of GET `path`, or None when nothing answers in time. Plain asyncio streams: no
    client library, no event-loop blocking."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, asyncio.TimeoutError):
        return None
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout_s)
        parts = line.split()
        return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None
    except (OSError, asyncio.TimeoutError, ValueError):
        return None
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
