"""What runs a step's compiled program: alone, or with the host pipeline around it.

`run_program` runs the program and raises what its NVMe transfers recorded.
`PipelineRunner` adds the host pipeline. The optimizer segments in the swap
store (NVMe, or host RAM) are updated by the host pipeline (`optim/pipeline.py`):
after the program, or while its backward pass is still running when backward
writes grads to the store (with clipping on, speculatively: a step whose
global norm needs clipping is rolled back and redone); grads held in arrays
are read once the program is done, a layer at a time, and the new params of
layers held in device arrays go back as they are made (`putback.PutBack`),
once the step is known to stand. With all-or-nothing steps every step is one
transaction of the swap store, so a step that fails leaves the previous step's
params and optimizer states in the store.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import math
import os
import threading
import time
from typing import Any, Callable, Sequence

import jax

from .grads import forward_order
from .inputs import shard_batch
from .optim.gate import GradGate
from .optim.pipeline import STATS
from .placement import PREFIX, Tier
from .putback import PutBack
from .schedule import timeline
from .shards import host_shards, start_host_shards, to_host

Step = Callable[[Any, Any], tuple[Any, dict]]


# swap-store keys of the states a step rewrites on NVMe (not the grads: scratch of one step)
VERSIONED = tuple(f"{PREFIX[s]}/" for s in ("params", "master", "mu", "nu"))


def all_or_nothing(engine, run: Step, what: str = "step") -> Step:
  """`run` as one transaction of the swap store: the params and optimizer states it rewrites on
  NVMe are committed when it returns and rolled back when it raises, so a failed step (an I/O
  error, a corrupted shard, a fault in the optimizer) leaves the previous step's there. `what`
  names `run` in the note a failure carries ("step", "flush")."""
  store = engine.store

  def step(state, batch):
    if store.in_transaction:  # left open by a step interrupted during its rollback
      store.rollback()
    store.begin(VERSIONED)
    try:
      out = run(state, batch)
    except BaseException as e:
      store.rollback()
      e.add_note(f"zinfjax: the {what} failed; the params and optimizer states on NVMe were "
                 "rolled back to those before it (nothing half-written). The TrainState passed "
                 f"in was donated to the {what}: continue from a checkpoint.")
      raise
    store.commit()
    return out

  return step


def run_program(engine, jitted, state, batch) -> tuple[Any, dict]:
  """The step's program alone (every optimizer segment it updates itself)."""
  new, metrics, _ = checked(engine, jitted(state, shard_batch(engine, batch)))
  return new, metrics


class PipelineRunner:
  """The step's program followed (or accompanied, under backward) by the host pipeline that
  updates the NVMe optimizer segments. `close()` joins its thread."""

  def __init__(self, engine, jitted, loss_fn):
    self.engine, self.jitted, self.loss_fn = engine, jitted, loss_fn
    pipeline = engine.pipeline
    self.clip, self.skip = engine.hyper.max_grad_norm, engine.config.skip_nonfinite
    # the update under backward is speculative (as if the grads need no clipping and are
    # finite): a step whose global norm turns out to need clipping is rolled back and redone,
    # one with a non-finite norm rolled back (skipped); all-or-nothing steps make both possible
    atomic = engine.config.nvme_atomic_steps
    # with every update one step late, the held update runs beside the whole program and
    # nothing of this step's grads is applied in it: nothing is speculative
    self.delayed = pipeline.delay == "all"
    self.under_backward = self.delayed or (pipeline.grads_on_store and (
        atomic or (self.clip is None and not self.skip)))
    self.ordered = False
    # the previous step's global norm: when it needed clipping, this one likely does too, and
    # the update under backward waits for the norm (its reads still go ahead) instead of
    # guessing "no clipping" and redoing the step
    self.last_norm: float | None = None
    # the pipeline under backward runs on its own thread, below the program's in priority
    self.thread = concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix="zinfjax-optim", initializer=lower_priority,
        initargs=(engine.config.host_nice,))

  def close(self) -> None:
    self.thread.shutdown(wait=True)

  def __call__(self, state, batch) -> tuple[Any, dict]:
    engine, pipeline = self.engine, self.engine.pipeline
    t0 = time.perf_counter()
    count = int(state.opt_state.count)
    pipeline.prepare(count)  # nothing the pipeline does under the program waits on the device
    batch = shard_batch(engine, batch)
    if self.under_backward:
      if not self.ordered:  # backward writes the grads in the reverse of the forward's order
        order = forward_order(engine, self.loss_fn, state.params, batch)
        pipeline.set_order(timeline(engine.plan, order).grad_order)
        self.ordered = True
      new, metrics, outs, t1, extra, back = self._under_backward(state, batch, count)
      skipped = False
    else:
      new, metrics, outs, t1, skipped, back = self._after(state, batch, count)
      extra = {}
    if pipeline.tail:  # the step stands: its tail grads wait for the next one
      norm = float(metrics["grad_norm"])
      pipeline.advance(norm, self.skipped(norm))
    new.params = back.finish(outs)
    pipeline.recycle(back.spent)
    stats = pipeline.last_step if not skipped else dict.fromkeys(STATS, 0.0)
    # after_program_s: the host's work after the program ended, on the step's critical path
    metrics = {**metrics, "fwd_bwd_s": t1 - t0, "after_program_s": time.perf_counter() - t1,
               "optimizer_s": stats["step_s"],
               "adam_s": stats["compute_s"], "nvme_read_wait_s": stats["read_wait_s"],
               "nvme_write_wait_s": stats["write_wait_s"], "nvme_bytes_read": stats["bytes_read"],
               "nvme_bytes_written": stats["bytes_written"], **extra}
    return new, metrics

  def skipped(self, norm: float) -> bool:
    """Whether a step whose global grad norm is `norm` is skipped (not finite)."""
    return self.skip and not math.isfinite(norm)

  def redo(self, norm: float, predicted: bool) -> bool:
    """Whether the update under backward, made as if no clipping were needed (not
    `predicted` from the norm), must be redone with clipping. Never when delayed: the held
    update stands, nothing to undo; nor for a skipped step."""
    return (not self.delayed and self.clip is not None and not predicted
            and not self.skipped(norm) and not norm < self.clip)

  def _after(self, state, batch, count):
    """The pipeline after the program (the grads or the global norm come from it)."""
    engine, plan = self.engine, self.engine.plan
    new, metrics, grads = checked(engine, self.jitted(state, batch))
    t1 = time.perf_counter()
    norm = float(metrics["grad_norm"])
    skipped = self.skipped(norm)
    back = PutBack(plan, new.params, lambda: True, engine.pipeline.pool)  # the step stands
    grad_of = grad_reader(plan, lambda: grads, engine.pipeline.array_grad_order())
    outs = {} if skipped else engine.pipeline.step(count, grad_of, grad_norm=norm, putback=back)
    return new, metrics, outs, t1, skipped, back

  def _under_backward(self, state, batch, count):
    """Grads land on NVMe layer by layer: each layer is updated while backward goes on below."""
    engine, pipeline, clip = self.engine, self.engine.pipeline, self.clip
    running: list = []
    ended: list[float] = []
    watched = threading.Event()  # the watch below is past the program's outputs
    gate = GradGate(engine.store, pipeline.grad_keys(),
                    lambda: bool(ended) or (bool(running) and all(
                        x.is_ready() for x in jax.tree.leaves(running))))
    running.extend(self.jitted(state, batch))  # dispatched: runs while the pipeline waits

    def watch_program():
      try:
        jax.block_until_ready(running)
        ended.append(time.perf_counter())
      finally:
        watched.set()

    watch = threading.Thread(target=watch_program, daemon=True)
    watch.start()
    predicted = clip is not None and self.last_norm is not None and not self.last_norm < clip

    def stands() -> bool | None:
      """Whether this pass's update stands: None while the program runs. New params go back
      to the device only once known (the params the program returned are then donated).
      With every update one step late, the held update stands whatever this step's norm."""
      if not all(x.is_ready() for x in jax.tree.leaves(running[1])):
        return None
      watched.wait()  # nothing it blocks on may be donated before
      norm = float(running[1]["grad_norm"])
      return self.delayed or not (self.skipped(norm) or self.redo(norm, predicted))

    back = PutBack(engine.plan, running[0].params, stands, pipeline.pool)
    if clip is None or self.delayed:
      guess = None
    elif predicted:  # the exact norm, once the program has it: nothing to redo
      guess = lambda: float(running[1]["grad_norm"])
    else:
      guess = 0.0  # a norm below the limit: no clipping (redone if wrong)
    # grads held in arrays (layers whose params are): read once the program is done
    grad_of = grad_reader(engine.plan, lambda: checked(engine, running[2]),
                          pipeline.array_grad_order())
    try:
      outs = self.thread.submit(pipeline.step, count, grad_of, gate, guess, back).result()
    except BaseException:
      watch.join()  # the program's own transfers end before anything is undone
      raise
    watch.join()
    new, (metrics, _) = running[0], checked(engine, tuple(running[1:]))  # its params: `back`'s
    extra: dict[str, Any] = {"nvme_grad_waits": gate.waited}
    norm = float(metrics["grad_norm"])
    skipped, redo = self.skipped(norm), self.redo(norm, predicted)
    if redo or (skipped and not self.delayed):  # back to the states before the update
      # the pipeline's alone: the params the program wrote to the store (of layers whose
      # optimizer it runs) are this step's, whether the pipeline's update is redone or not
      engine.store.rollback(pipeline.written_keys())
      if redo:  # again, with clipping: it stands
        back.again()
      outs = pipeline.step(count, grad_of, None, norm, back) if redo else {}
    if clip is not None:
      extra["nvme_redone"] = int(redo)
      extra["nvme_clip_predicted"] = int(predicted)
      self.last_norm = norm
    return new, metrics, outs, ended[0], extra, back


def grad_reader(plan, grads: Callable[[], Any], order: Sequence[tuple[int, int]] = ()) -> Callable:
  """`grad_of(part)`: a part's grad from the program's grad arrays (`grads()`, asked once),
  as a host array. Grads on the device are copied a layer at a time, each let go once every
  rank of this process has had it: the host holds a few layers' grads, not a whole segment
  of them (two bytes a param of every layer whose params are on the device). `order` is the
  order (leaf, layer) pairs will be asked in: as one is asked, the copies of those after it
  start, up to a layer of the largest stack ahead (`autoplace.read_bytes` counts them), so
  a layer crosses while the update runs on the one before; on an accelerator each through
  pinned host (`shards.start_host_shards`). Grads in pinned host (no device op slices them)
  are read a segment at a time, once."""
  cache: dict[tuple[int, int], dict] = {}  # (leaf, layer or -1 - segment) -> rank -> shard
  coming: dict[tuple[int, int], dict] = {}  # (leaf, layer) -> rank -> shard on its way
  flat: list = []  # the grads per plan leaf, once asked for
  item = plan.dtype("grads").itemsize
  size = lambda key: plan.leaves[key[0]].local_size * len(plan.ranks) * item
  ahead = plan.stack_layer_size * len(plan.ranks) * item
  at = {key: k for k, key in enumerate(order)}

  def where(leaf, layer: int):
    return next((j, s) for j, s in enumerate(leaf.array_segments("grads")) if layer in s)

  def arrays(leaf: int) -> tuple:
    """The program's grad arrays of one leaf (all of them asked for once)."""
    if not flat:
      flat.append(plan.flatten(grads()))
    return flat[0][leaf]

  def start(key: tuple[int, int]) -> dict:
    """The copies of one layer's shards (every rank of this process) to the host, started."""
    leaf = plan.leaves[key[0]]
    j, seg = where(leaf, key[1])
    return start_host_shards(arrays(key[0])[j], plan.mesh,
                             key[1] - seg.start if leaf.stacked else None, pinned=True)

  def read_ahead(key: tuple[int, int]) -> None:
    """Start the copies of the device layers after `key` in `order`, up to `ahead` bytes."""
    held = sum(size(k) for k in coming)
    for k in order[at[key] + 1:] if key in at else ():
      if k in coming or k in cache or where(plan.leaves[k[0]], k[1])[1].tier is not Tier.DEVICE:
        continue
      if held + size(k) > ahead:
        return
      coming[k] = start(k)
      held += size(k)

  def grad_of(p):
    leaf = plan.leaves[p.leaf]
    j, seg = where(leaf, p.layer)
    by_layer = seg.tier is Tier.DEVICE  # let go once taken
    key = (p.leaf, p.layer) if by_layer else (p.leaf, -1 - j)
    if p.rank not in cache.get(key, {}):  # not read yet (or read again: a redone update)
      if by_layer:
        cache[key] = to_host(coming.pop(key, None) or start(key))
        read_ahead(key)
      else:
        cache[key] = host_shards(arrays(p.leaf)[j], plan.mesh)
    if not by_layer:
      g = cache[key][p.rank]
      return g[p.layer - seg.start] if leaf.stacked else g
    g = cache[key].pop(p.rank)
    if not cache[key]:
      del cache[key]
    return g

  return grad_of


def lower_priority(nice: int, name: bytes = b"zinfjax-optim") -> None:
  """Name the calling thread (for top -H) and add `nice` to its nice value (Linux: per
  thread; threads it starts, such as the AdamW kernel's, inherit it)."""
  try:
    ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)  # PR_SET_NAME
  except (OSError, AttributeError):
    pass
  if nice > 0 and hasattr(os, "setpriority"):
    tid = threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


def checked(engine, outputs):
  """`outputs` once the step is done, raising any error its NVMe transfers recorded."""
  if engine.store is not None:
    jax.block_until_ready(outputs)
    engine.store.raise_deferred()
  return outputs
