"""Helpers for the tests, not tests themselves (pytest collects nothing here).

Test modules import them as ``support.<module>``: tests/ is on sys.path through the root
conftest (pytest's default "prepend" import mode).

  two_cpu_run.py       run a snippet in a subprocess pinned to 2 CPUs (thread-pool deadlocks)
  train_stand_ins.py   TinyMLP and make_arrays: a model and data for the attnx.train tests
  kill_run.py          a checkpointed fit that SIGKILLs itself mid-run (script and module)
  parallel_check.py    script: fit on 8 fake CPU devices in every parallel mode, prints JSON
  checkpoints.py       read_state: a run's checkpointed train state as numpy arrays
  scripts.py           cpu_env, script_result (a support script's RESULT JSON), metric_records
  ring_cases.py        the case table of ring attention's 8-device check (no side effects)
  ring_draws.py        seeded random ring problems (the CI sample, the large run; no side effects)
  ring_check.py        script: ring attention on 8 fake CPU devices vs float64, prints JSON
  ring_memory.py       script: per-device memory of ring vs single-device attention
  sequence_axis_check.py  script: GPT on 8 sequence shards vs the whole sequence, prints JSON
  fit_reference.json   data: fit's results from before the actions refactoring (test_loop.py)
  nn_models.py         small helpers shared by the attnx.nn tests
"""
