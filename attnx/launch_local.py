"""Run a launch.py experiment as N JAX processes on this machine (like ``torchrun
--nproc_per_node``).

  python -m attnx.launch_local -n 2 [--devices_per_process=2] -- launch.py --config=... [...]

Starts N copies of the command with ``--config.distributed=True
--config.coordinator_address=127.0.0.1:PORT --config.num_processes=N --config.process_id=i``
appended (PORT a free port of this machine; with ``--devices_per_process=K`` also
``--config.num_cpu_devices=K``: K fake CPU devices per process). Each line a process prints
comes out prefixed by its rank, ``[1] ...``, on the launcher's stdout or stderr as it was
printed. When one process exits non-zero (or is killed), the others are stopped (SIGTERM,
then SIGKILL after ``--grace_seconds``; launch.py workers exit at once on SIGTERM), so a dead
peer never leaves the others waiting in a collective. Ctrl-C stops them all.

Exit status (launch.py's own table, extended):
  0      every process exited 0;
  1-5    the status of the first process that failed, which for launch.py means: 1 a run
         stopped on a NaN/Inf loss, 2 a launch-time mistake, 3 damaged checkpoints, 4 an
         unexpected error (its traceback is printed), 5 a peer process was lost;
  2      also: the launcher's own command line is wrong, or the command cannot be run
         (nothing is started);
  128+N  a process was killed by signal N (137: SIGKILL, e.g. the out-of-memory killer);
  130    Ctrl-C.
A command other than launch.py passes its own status through.

Across real hosts, run launch.py on each host yourself with the same four flags (the address
of process 0's host, the number of processes, each host's id), as "Many processes, many hosts" in
docs/guides/experiments.md shows; on CPU, collectives between processes go through gloo.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port no process on `host` listens on now (the OS's choice)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return int(s.getsockname()[1])


def process_flags(rank: int, num_processes: int, coordinator: str,
                  devices_per_process: int = 0) -> list[str]:
  """The launch.py flags that make process `rank` one of `num_processes`."""
  flags = ["--config.distributed=True", f"--config.coordinator_address={coordinator}",
           f"--config.num_processes={num_processes}", f"--config.process_id={rank}"]
  if devices_per_process > 0:
    flags.append(f"--config.num_cpu_devices={devices_per_process}")
  return flags


def _pump(stream: TextIO, out: TextIO, prefix: str, lock: threading.Lock) -> None:
  """Copy `stream` to `out` line by line with `prefix` (whole lines: ranks never interleave)."""
  for line in iter(stream.readline, ""):
    with lock:
      out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
      out.flush()
  stream.close()


USAGE_STATUS = 2  # launch.py's "launch-time mistake"
LOST_PEER_STATUS = 5  # launch.py's "a peer process was lost": a consequence, not a cause
EXAMPLE = "python -m attnx.launch_local -n 2 -- launch.py --config=experiments/NAME.py"


def _status(code: int) -> int:
  """A shell's exit status for a child's return code (-N: killed by signal N -> 128 + N)."""
  return 128 - code if code < 0 else code


def _describe(rank: int, code: int) -> str:
  if code < 0:
    try:
      name = signal.Signals(-code).name
    except ValueError:
      name = "an unknown signal"
    return f"process {rank} was killed by signal {-code} ({name}; status {_status(code)})"
  return f"process {rank} exited with status {code}"


def check_command(command: Sequence[str]) -> str | None:
  """Why `command` cannot be started (one line), or None when it can.

  The command is a script (``*.py``, run with this Python) or a program on PATH.
  """
  if not command:
    return f"no command: pass the script after --, e.g. {EXAMPLE}"
  first = command[0]
  if first.startswith("-"):
    return (f"the command must start with a script or program, not the flag {first!r} "
            f"(launch.py left out?); e.g. {EXAMPLE}")
  if first.endswith(".py"):
    if not os.path.isfile(first):
      return f"no such script: {first!r} (from {os.getcwd()}); e.g. {EXAMPLE}"
    return None
  if shutil.which(first) is None:
    return (f"cannot run {first!r}: not a .py script or an executable program on PATH; "
            f"e.g. {EXAMPLE}")
  return None


def _stop(procs: list[subprocess.Popen], grace_seconds: float) -> list[tuple[int, str]]:
  """SIGTERM every live process group, then SIGKILL what is left after `grace_seconds`.

  Returns (rank, how it stopped) of each process that was still running.
  """
  live = [(r, p) for r, p in enumerate(procs) if p.poll() is None]
  for _, p in live:
    _signal_group(p, signal.SIGTERM)
  deadline = time.monotonic() + grace_seconds
  while any(p.poll() is None for _, p in live) and time.monotonic() < deadline:
    time.sleep(0.05)
  stopped = []
  for r, p in live:
    if p.poll() is None:
      _signal_group(p, signal.SIGKILL)
      stopped.append((r, f"SIGKILL after {grace_seconds:g} s"))
    else:
      stopped.append((r, "SIGTERM" if p.returncode == -signal.SIGTERM else
                      f"exited with status {_status(p.returncode)} after SIGTERM"))
  for _, p in live:
    p.wait()
  return stopped


def _first_failure(procs: list[subprocess.Popen]) -> tuple[int, int] | None:
  """(rank, return code) of a failed process, preferring a cause over a lost peer."""
  failed = [(r, p.returncode) for r, p in enumerate(procs)
            if p.returncode is not None and p.returncode != 0]
  causes = [f for f in failed if f[1] != LOST_PEER_STATUS]
  return (causes or failed or [None])[0]


def _signal_group(p: subprocess.Popen, sig: int) -> None:
  try:
    os.killpg(p.pid, sig)  # the process and whatever it started
  except ProcessLookupError:
    pass


def launch(command: Sequence[str], num_processes: int, devices_per_process: int = 0,
           grace_seconds: float = 5.0, port: int = 0,
           stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
  """Run `command` (a Python script and its arguments) as `num_processes` JAX processes.

  Returns 0 when every process exits 0, else the exit status of the first one that failed
  (the others having been stopped; a process that only reports a lost peer is not taken for
  the cause when another one failed). See the module docstring for the statuses. Raises
  ValueError for a command that cannot be run (`check_command`), before starting anything.
  """
  if num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes}")
  problem = check_command(command)
  if problem:
    raise ValueError(problem)
  stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
  coordinator = f"127.0.0.1:{port or free_port()}"
  argv = list(command)
  if argv[0].endswith(".py"):
    argv = [sys.executable] + argv
  lock = threading.Lock()
  procs: list[subprocess.Popen] = []
  pumps: list[threading.Thread] = []

  def say(line: str) -> None:
    with lock:
      stderr.write(f"launch_local: {line}\n")
      stderr.flush()

  try:
    for rank in range(num_processes):
      p = subprocess.Popen(
          argv + process_flags(rank, num_processes, coordinator, devices_per_process),
          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
          start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
      procs.append(p)
      for stream, out in ((p.stdout, stdout), (p.stderr, stderr)):
        t = threading.Thread(target=_pump, args=(stream, out, f"[{rank}] ", lock), daemon=True)
        t.start()
        pumps.append(t)
    failed: tuple[int, int] | None = None
    while failed is None:
      codes = [p.poll() for p in procs]  # every one: poll() is what sets returncode
      failed = _first_failure(procs)
      if all(c is not None for c in codes):
        break
      time.sleep(0.05)
    if failed is not None and failed[1] == LOST_PEER_STATUS:
      # A peer's loss is reported by the survivors, often before the peer's own end is seen.
      deadline = time.monotonic() + 2.0
      while time.monotonic() < deadline and failed[1] == LOST_PEER_STATUS:
        time.sleep(0.05)
        for p in procs:
          p.poll()
        failed = _first_failure(procs)
    if failed is not None:
      rank, code = failed
      say(f"{_describe(rank, code)}; stopping the others")
      for r, how in _stop(procs, grace_seconds):
        say(f"stopped process {r} ({how})")
      status = _status(code)
    else:
      status = 0
  except OSError as e:  # the program vanished or is not executable after all
    say(f"cannot start {argv[0]!r}: {e.strerror or e}")
    status = USAGE_STATUS
  except KeyboardInterrupt:
    _stop(procs, grace_seconds)
    status = 130
  finally:
    _stop(procs, grace_seconds)
    for t in pumps:
      t.join(timeout=5)
  return status


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m attnx.launch_local", description=__doc__.split("\n\n")[0],
      usage="%(prog)s -n N [--devices_per_process K] -- launch.py --config=... [flags]")
  parser.add_argument("-n", "--num_processes", type=int, required=True,
                      help="processes to start on this machine")
  parser.add_argument("--devices_per_process", type=int, default=0,
                      help="fake CPU devices per process (--config.num_cpu_devices); 0: leave")
  parser.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
  parser.add_argument("--grace_seconds", type=float, default=5.0,
                      help="after SIGTERM, seconds before the others are killed")
  parser.add_argument("command", nargs=argparse.REMAINDER,
                      help="-- then the script and its flags")
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if args.num_processes < 1:
    parser.error(f"-n must be >= 1, got {args.num_processes}")
  if args.devices_per_process < 0:
    parser.error(f"--devices_per_process must be >= 0, got {args.devices_per_process}")
  problem = check_command(command)
  if problem:  # one line, no usage block: the line says how the command should look
    print(f"launch_local: {problem}", file=sys.stderr)
    return USAGE_STATUS
  return launch(command, args.num_processes, args.devices_per_process, args.grace_seconds,
                args.port)


if __name__ == "__main__":
  sys.exit(main())
