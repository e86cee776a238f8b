"""Running a command on N local ranks under torchrun, within a deadline (the ``--nproc`` commands).

The parent (``fxpipe demo --nproc 2``) starts ``python -m torch.distributed.run
--nproc-per-node=N --master-addr=127.0.0.1 --master-port=<free>`` on
:mod:`fxpipe.cli._ranks`, which runs the command on every rank with gloo. The ranks'
standard output is copied through as it comes (rank 0 prints the report); their standard
error is kept, so a failure is shown as each rank's one-line error
(``fxpipe rank R: error: ...``) rather than torchrun's tracebacks. Rank 0 writes the
command's result (JSON) into a private directory. When the deadline passes, every rank
(by the pid it wrote there) and torchrun are killed: no rank outlives the command.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Optional

__all__ = ["Finished", "run_ranks", "free_port", "RANK_ENTRY", "error_line_of_rank", "RESULT_FILE"]

#: the module torchrun runs on each rank
RANK_ENTRY = "fxpipe.cli._ranks"
RESULT_FILE = "result.json"
_RANK_ERROR = re.compile(r"^fxpipe rank (\d+): error: (.*)$")
_GRACE_SECONDS = 10.0


def error_line_of_rank(rank: int, message: str) -> str:
    """The line a rank prints on stderr when its command fails (parsed back by the parent)."""
    return f"fxpipe rank {rank}: error: {message}"


@dataclass
class Finished:
    """How the ranks ended."""

    returncode: int
    timed_out: bool
    #: rank -> its one-line error
    errors: dict[int, str] = field(default_factory=dict)
    #: everything torchrun and the ranks wrote on stderr
    stderr: str = ""
    #: what rank 0 wrote as the command's result, or None
    result: Optional[dict] = None

    def error_summary(self) -> str:
        """The ranks' errors, one line each, ranks with the same message merged."""
        by_message: dict[str, list[int]] = {}
        for rank, message in sorted(self.errors.items()):
            by_message.setdefault(message, []).append(rank)
        return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {m}"
                         for m, r in by_message.items())


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the rendezvous port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pump(stream: IO[str], sink: Callable[[str], None]) -> None:
    for line in stream:
        sink(line)


def _copy_out(line: str) -> None:
    try:
        sys.stdout.write(line)
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):  # `fxpipe demo --nproc 2 | head`: keep draining the ranks
        pass


def _kill_ranks(workdir: Path) -> None:
    """SIGKILL every rank that wrote its pid and is still one of ours (its command line names
    the rank entry, where /proc tells)."""
    for pid_file in workdir.glob("pid.*"):
        try:
            pid = int(pid_file.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline")
            if cmdline.exists() and RANK_ENTRY.encode() not in cmdline.read_bytes():
                continue
            os.kill(pid, signal.SIGKILL)
        except (ValueError, OSError):
            continue


def _stop(proc: subprocess.Popen, workdir: Path) -> None:
    _kill_ranks(workdir)
    proc.terminate()
    try:
        proc.wait(_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_ranks(nproc: int, options: dict[str, Any], *, timeout: float) -> Finished:
    """Runs the command ``options`` (the parsed command line, as a dict) on ``nproc`` local
    ranks; returns within ``timeout`` seconds (plus a few to stop them) however they end."""
    with tempfile.TemporaryDirectory(prefix="fxpipe-ranks-") as tmp:
        workdir = Path(tmp)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", RANK_ENTRY,
               "--workdir", tmp, "--options", json.dumps(options)]
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])  # the ranks import this fxpipe
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its warning
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env)
        err: list[str] = []
        pumps = [threading.Thread(target=_pump, args=(proc.stdout, _copy_out), daemon=True),
                 threading.Thread(target=_pump, args=(proc.stderr, err.append), daemon=True)]
        for t in pumps:
            t.start()
        timed_out = False
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(proc, workdir)
        except BaseException:  # Ctrl-C: no rank is left behind
            _stop(proc, workdir)
            raise
        for t in pumps:
            t.join(_GRACE_SECONDS)
        errors = {}
        for line in err:
            m = _RANK_ERROR.match(line.rstrip("\n"))
            if m:
                errors.setdefault(int(m.group(1)), m.group(2))
        result_path = workdir / RESULT_FILE
        result = json.loads(result_path.read_text()) if result_path.exists() else None
        return Finished(proc.returncode, timed_out, errors, "".join(err), result)
