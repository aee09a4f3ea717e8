"""Run a launch.py experiment as N JAX processes on this machine (like ``torchrun
--nproc_per_node``).

  python -m attnx.launch_local -n 2 [--devices_per_process=2] -- launch.py --config=... [...]

Starts N copies of the command with ``--config.distributed=True
--config.coordinator_address=127.0.0.1:PORT --config.num_processes=N --config.process_id=i``
appended (PORT a free port of this machine; with ``--devices_per_process=K`` also
``--config.num_cpu_devices=K``: K fake CPU devices per process). Each line a process prints
comes out prefixed by its rank, ``[1] ...``, on the launcher's stdout or stderr as it was
printed. When one process exits non-zero (or is killed), the others are stopped (SIGTERM,
then SIGKILL after ``--grace_seconds``) and the launcher exits with that process's status
(128 + N for signal N), so a dead peer never leaves the others waiting in a collective.
Ctrl-C stops them all.

Across real hosts, run launch.py on each host yourself with the same four flags (the address
of process 0's host, the number of processes, each host's id), as "Many processes, many hosts" in
docs/guides/experiments.md shows; on CPU, collectives between processes go through gloo.
"""

from __future__ import annotations

import argparse
import os
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


def _status(code: int) -> int:
  """A shell's exit status for a child's return code (-N: killed by signal N -> 128 + N)."""
  return 128 - code if code < 0 else code


def _stop(procs: list[subprocess.Popen], grace_seconds: float) -> None:
  """SIGTERM every live process group, then SIGKILL what is left after `grace_seconds`."""
  live = [p for p in procs if p.poll() is None]
  for p in live:
    _signal_group(p, signal.SIGTERM)
  deadline = time.monotonic() + grace_seconds
  while any(p.poll() is None for p in live) and time.monotonic() < deadline:
    time.sleep(0.05)
  for p in live:
    if p.poll() is None:
      _signal_group(p, signal.SIGKILL)
  for p in live:
    p.wait()


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
  (the others having been stopped). See the module docstring.
  """
  if num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes}")
  if not command:
    raise ValueError("no command: pass the script after --, e.g. -- launch.py --config=...")
  stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
  coordinator = f"127.0.0.1:{port or free_port()}"
  argv = list(command)
  if argv[0].endswith(".py"):
    argv = [sys.executable] + argv
  lock = threading.Lock()
  procs: list[subprocess.Popen] = []
  pumps: list[threading.Thread] = []
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
      failed = next(((r, c) for r, c in enumerate(codes) if c not in (None, 0)), None)
      if all(c is not None for c in codes):
        break
      time.sleep(0.05)
    if failed is not None:
      rank, code = failed
      with lock:
        stderr.write(f"launch_local: process {rank} exited with status {_status(code)}; "
                     "stopping the others\n")
        stderr.flush()
      _stop(procs, grace_seconds)
      status = _status(code)
    else:
      status = 0
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
  if not command:
    parser.error("no command: pass the script after --, e.g. -- launch.py --config=...")
  return launch(command, args.num_processes, args.devices_per_process, args.grace_seconds,
                args.port)


if __name__ == "__main__":
  sys.exit(main())
