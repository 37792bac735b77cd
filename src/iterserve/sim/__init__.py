"""The simulator: the real scheduler (core/) and engine loop (engine/engine_core.py)
stepping against a cost model on a virtual clock, no model run.

  executor.py         the simulated executor, virtual clock and roofline cost model
  cost_profile.py     step prices measured on the real engine (profiles/ ships some)
  profile.py          `iterserve bench profile`: measure such a profile
  fidelity.py         `iterserve bench fidelity`: one workload real and simulated, compared
  fleet.py            replicas behind a router, replayed on one process
  block_hash_feed.py  the fleet's KV block names, hashed ahead on the second core
  replay_pool.py      a replica's block pool, which maps those names only when asked
  decode_cohort.py    steady decodes advanced in aggregate (a million requests in minutes),
  cohort_scheduler.py   the Scheduler that holds them aside through core's hooks,
  engine.py             and the engine loop that runs their steps

`iterserve simulate` is cli/simulate.py. Nothing in core/, engine/, executor/ or
server/ imports this package (tests/test_structure.py).
"""
