"""`flush_updates`: the updates `ZeroConfig.delay_update` holds for a next step, applied now.

Under a delay the last step's grads of the delayed parts wait for a step that
may never come: a model taken out of the state after the loop (`state.model()`,
`full_params`, `hf.save`) would miss that step's update of those params. A
flush runs that update on the host pipeline at once (the held step's count and
clipping, as the next step would have), writes the new params where they live
(the swap store, or their arrays), and holds nothing; the next step, if any,
holds its own grads as a run's first step does.
"""

from __future__ import annotations

import dataclasses

from .putback import PutBack
from .runner import all_or_nothing
from .state import TrainState


def flush_updates(state: TrainState) -> TrainState:
  """`state` with the updates `ZeroConfig.delay_update` holds applied, so its params have seen
  every step's grads: call it before taking the model out. Like a step it consumes `state` (use
  the state returned). A state with nothing held is returned as it is."""
  state.check_usable("flush_updates")
  engine = state.engine
  pipeline = engine.pipeline
  if pipeline is None or pipeline.holding is None:
    return state

  def run(state: TrainState, _) -> tuple[TrainState, dict]:
    back = PutBack(engine.plan, state.params, lambda: True, pipeline.pool)
    params = back.finish(pipeline.flush())
    pipeline.recycle(back.spent)
    return dataclasses.replace(state, params=params), {}

  if engine.store is not None and engine.config.nvme_atomic_steps:
    run = all_or_nothing(engine, run, "flush")  # a failed flush leaves the store as it was
  try:
    new, _ = run(state, None)
  except BaseException:
    if state.arrays_deleted():
      state.consumed = ("this TrainState was given to flush_updates, which failed after taking "
                        "its arrays. Restore the last checkpoint to go on.")
    raise
  state.consumed = ("this TrainState was given to flush_updates, which updated its params: use "
                    "the state it returned: `state = zinfjax.flush_updates(state)`.")
  return new
