"""attnx.train.workarounds: which setups sync every step."""

from __future__ import annotations

from attnx.train import workarounds


def test_sync_every_step_only_for_data_parallel_cpu():
  assert workarounds.sync_every_step("shard_map", "cpu")
  assert workarounds.sync_every_step("pmap", "cpu")
  assert not workarounds.sync_every_step("none", "cpu")
  assert not workarounds.sync_every_step("shard_map", "gpu")
