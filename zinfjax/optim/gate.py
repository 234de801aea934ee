"""`GradGate`: which grads a running backward pass has written to the swap store, for the
host pipeline's update under backward (`runner.PipelineRunner`)."""

from __future__ import annotations

from typing import Callable, Sequence

from ..offload.store import AioStore


class GradGate:
  """Tells the NVMe optimizer which grads a running backward pass has written.

  Built just before the step's program is dispatched: each grad key must
  reach one more completed write than it had then. `program_done()` says
  whether the program has finished; a grad still missing after that means
  the program failed to write it, and `wait` raises the engine's recorded
  error instead of waiting forever.
  """

  def __init__(self, store: AioStore, keys: Sequence[str], program_done: Callable[[], bool]):
    self.store, self.program_done = store, program_done
    self.want = {k: store.generation(k) + 1 for k in keys}
    self.waited = 0  # grads the optimizer reached before backward had written them

  def ready(self, key: str) -> bool:
    return self.store.generation(key) >= self.want[key]

  def wait(self, key: str, poll_s: float = 0.5) -> None:
    self.waited += 1
    while not self.store.wait_generation(key, self.want[key], poll_s):
      if self.program_done() and not self.ready(key):
        self.store.raise_deferred()
        raise RuntimeError(f"the step's program finished without writing grad shard {key!r}.")
