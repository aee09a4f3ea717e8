"""A small checkpointed `fit` that can SIGKILL itself mid-run (see tests/train/test_loop.py).

  python kill_run.py WORKDIR KILL_AT   # trains, kills its own process when batch KILL_AT is read

Run in-process with `run(workdir)` to resume and finish the same run.
"""

from __future__ import annotations

import os
import signal
import struct
import sys

# tests/ on the path: run as a script, this file imports its sibling as support.train_stand_ins.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attnx import train  # noqa: E402
from support.train_stand_ins import TinyMLP, make_arrays  # noqa: E402

NUM_STEPS, LOG_EVERY, CHECKPOINT_EVERY = 12, 2, 4


def run(workdir: str, kill_at: int | None = None) -> train.FitResult:
  arrays = make_arrays()

  def data(seed, start):
    for step, batch in enumerate(train.array_stream(arrays, 16, seed, start), start=start):
      if kill_at is not None and step >= kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
      yield batch

  config = train.FitConfig(optimizer=train.optimizer_config(), num_steps=NUM_STEPS,
                           log_every=LOG_EVERY, checkpoint_every=CHECKPOINT_EVERY,
                           progress=False, tensorboard=True)
  return train.fit(TinyMLP(), train_data=data, config=config, workdir=workdir)


def tensorboard_scalars(logdir: str, tag: str) -> list[tuple[int, float]]:
  """(step, value) of `tag` as TensorBoard shows them: event files in order, and a
  SessionLog.START at step s (a writer's purge_step) hides the earlier events with step >= s."""
  from tensorboardX.proto import event_pb2

  kept: list[tuple[int, float]] = []
  for name in sorted(f for f in os.listdir(logdir) if f.startswith("events.")):
    with open(os.path.join(logdir, name), "rb") as f:
      data = f.read()
    pos = 0
    while pos + 12 <= len(data):  # TFRecord: u64 length, u32 crc, payload, u32 crc
      (n,) = struct.unpack("<Q", data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
      pos += 12 + n + 4
      if event.HasField("session_log") and event.session_log.status == event.session_log.START:
        kept = [(s, v) for s, v in kept if s < event.step]
      kept += [(event.step, v.simple_value) for v in event.summary.value if v.tag == tag]
  return kept


if __name__ == "__main__":
  run(sys.argv[1], int(sys.argv[2]))
