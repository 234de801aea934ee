"""`Checkpointer`: checkpoints of a `TrainState` on every tier, through orbax-checkpoint.

One orbax step folder per saved step (`directory/<step>/`), written under a
temporary name and renamed once every process is done (a save killed half
way leaves the previous steps intact), the last `keep` kept:

  meta/metadata   JSON: format, step, every leaf's logical shape and dtype,
                  the ZeRO config and mesh it came from, the caller's `extra`
  state/<name>    one zarr3 array per leaf (tensorstore), in its logical
                  (unpadded) shape, chunked as one rank's shard of one layer,
                  every chunk crc32c-checked

What is stored is in `leaves.py`, how each process moves its shards in
`handler.py`. The format knows nothing of the run's mesh or tiers, so a
checkpoint restores onto any number of devices and any placement.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from ..engine import build_engine
from ..optim.host import HostAdamState
from ..partition import key_name
from ..progress import InitReport
from ..state import TrainState, make_states
from . import lock as dirlock
from .errors import CheckpointError, CheckpointMismatch
from .handler import Run, StateHandler, StateRestore, StateSave
from .held import held_leaves, held_targets, restore_held
from .leaves import Leaf, state_leaves

FORMAT = "zinfjax-checkpoint/1"


# ------------------------------------------------------------------ manager
class Checkpointer:
  """Saves and restores zinfjax training states in `directory`, keeping the last `keep`.

    ckpt = Checkpointer("/ckpt/run1", keep=3)
    ckpt.save(state, extra={"data_step": 100})     # returns once the state may change
    state, extra = ckpt.restore(model_factory, tx, config, mesh)   # latest step

  `save` is asynchronous: device and pinned-host shards are written in the
  background (NVMe shards before it returns); `wait()` blocks until the last
  save is committed, and `check()` (cheap: call it every step) raises at once
  when a background save has failed. Every process of a multi-process run
  calls them.
  """

  def __init__(self, directory: str | os.PathLike, *, keep: int | None = 3, async_save: bool = True,
               lock: bool = False):
    """`lock`: make the directory, check it is writable and lock it against other runs now
    (a run that will save here: its problems show before any compute). Otherwise the lock is
    taken at the first `save`, and a Checkpointer that only reads never takes it."""
    if keep is not None and keep < 1:
      raise ValueError(f"keep={keep}: keep at least 1 checkpoint (or None for all).")
    self.directory = os.path.abspath(os.fspath(directory))
    if os.path.exists(self.directory) and not os.path.isdir(self.directory):
      raise CheckpointError(f"checkpoint directory {self.directory} is a file; give a folder.")
    self._unlock = None
    if lock:
      self.lock()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=False, enable_async_checkpointing=async_save,
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
    self._handler = StateHandler()
    self._manager = None
    self._options = options
    self._saving: int | None = None  # the step of the last save started in the background

  @property
  def manager(self) -> ocp.CheckpointManager:
    if self._manager is None:
      self._manager = ocp.CheckpointManager(
          self.directory, options=self._options,
          item_handlers={"state": self._handler, "meta": ocp.JsonCheckpointHandler()})
    return self._manager

  def lock(self) -> None:
    """Take the directory's lock for this run (process 0 of a multi-process run), once. Every
    process makes the directory: each then sees it, so all or none create orbax's manager
    (a collective) in `all_steps`."""
    if self._unlock is not None:
      return
    if jax.process_index() != 0:
      dirlock.make(self.directory)
      return
    dirlock.acquire(self.directory)
    # released by close(), or when this object is collected
    self._unlock = weakref.finalize(self, dirlock.release, self.directory)

  def all_steps(self) -> list[int]:
    """Committed steps, oldest first, and the one this Checkpointer is saving in the background
    (folders of saves that did not finish are not steps)."""
    if not os.path.isdir(self.directory):
      return []
    return sorted(self.manager.all_steps())

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  # ---------------------------------------------------------------- save
  def save(self, state, *, extra: dict | None = None) -> bool:
    """Save `state` as step `state.step`; False when that step is already saved."""
    state.check_usable("Checkpointer.save")
    step = int(jax.device_get(state.step.addressable_data(0)))
    self.check()
    self.lock()  # makes the directory
    if step in self.all_steps():
      return False
    engine = state.engine
    held, held_meta = held_leaves(state)  # delay_update's held grads, waiting for their update
    leaves = state_leaves(state) + held
    meta = {"format": FORMAT, "step": step, "held": held_meta,
            "leaves": {l.name: {"shape": list(l.shape), "dtype": np.dtype(l.dtype).name}
                       for l in leaves},
            "config": _config_json(engine.config), "devices": engine.dp,
            "processes": jax.process_count(), "extra": extra or {}}
    run = Run(leaves, engine.plan, engine.store)
    self._saving = step  # the step a failure names (`_reported` clears it)
    self._reported(lambda: self.manager.save(
        step, args=ocp.args.Composite(state=StateSave(run), meta=ocp.args.JsonSave(meta))),
        background=False)
    self._saving = step  # its device and pinned-host shards still being written
    return True

  def wait(self) -> None:
    """Block until every save started is committed (`CheckpointError` if one failed)."""
    if self._manager is not None:
      self._reported(self._manager.wait_until_finished)

  def check(self) -> None:
    """Raise `CheckpointError` if a background save failed (disk full, folder removed) since
    the last check; returns at once otherwise, whether or not a save is still running."""
    if self._manager is not None and self._saving is not None:
      if not self._manager.is_saving_in_progress():
        self._reported(self._manager.wait_until_finished)  # done: returns at once or raises

  def _reported(self, fn: Callable[[], None], background: bool = True) -> None:
    """Run `fn` (a save, or a wait on the one in the background); a failure becomes one
    `CheckpointError` naming the step and the last committed one, its half-written folder
    removed (a full drive keeps what space it had)."""
    try:
      fn()
      self._saving = None
    except Exception as e:  # noqa: BLE001 - orbax re-raises the background thread's error
      step, self._saving = self._saving, None
      self._remove_unfinished(step)
      steps = [s for s in self.all_steps() if s != step]
      last = f"the last committed checkpoint is step {steps[-1]}" if steps else "no step is committed"
      first = (str(e).strip().splitlines() or [""])[0][:400]
      raise CheckpointError(
          f"saving step {step} to {self.directory} failed{' in the background' if background else ''}"
          f": {type(e).__name__}: {first}. Nothing earlier was lost ({last}); free space there or "
          "choose another checkpoint directory.") from e

  def _remove_unfinished(self, step: int | None) -> None:
    """Delete the temporary folder of a save of `step` that failed (process 0 owns them)."""
    if step is None or jax.process_index() != 0 or not os.path.isdir(self.directory):
      return
    for name in os.listdir(self.directory):
      if name.startswith(f"{step}.orbax-checkpoint-tmp"):
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  # ---------------------------------------------------------------- restore
  def metadata(self, step: int | None = None) -> dict:
    """The JSON metadata of `step` (default: the latest); `["step"]` is the step it holds. A save
    of this Checkpointer still in the background is waited for: its step is listed already."""
    self.wait()
    return read_metadata(self.directory, step, self.all_steps())

  def restore(self, model_factory: Callable, tx: optax.GradientTransformation, config, mesh, *,
              step: int | None = None, progress: InitReport | None = None):
    """`(state, extra)`: the training state of `step` (default: the latest) placed as `config`
    says on `mesh`, whatever placement and device count it was saved from. `progress` is
    called with (bytes placed, bytes in all, seconds so far) every 2 s or so of a long restore
    (this process's shards), and once at its end (`zinfjax.progress.init_line(unit="bytes")`
    prints a line)."""
    meta = self.metadata(step)
    step = meta["step"]
    engine = build_engine(model_factory, tx, config, mesh)
    try:
      target = make_states(engine, model_factory, abstract=True)
      leaves = _restore_targets(target)
      _check_compatible(meta, leaves, self.directory, step)
      held = held_targets(engine, meta)
      run = Run(leaves + held, engine.plan, engine.store, progress)
      restored = self.manager.restore(step, args=ocp.args.Composite(state=StateRestore(run)))["state"]
      if engine.store is not None:
        engine.store.sync()
      restore_held(engine, restored, held, meta)
    except BaseException:
      engine.close("its restore failed")  # its folders stay locked until closed
      raise
    plan = engine.plan

    def parts(prefix: str, derived: bool) -> Any:
      out = []
      for leaf in plan.leaves:
        stored, want = prefix, derived
        # a frozen leaf has no master or moments: its params are stored, as `params/`
        if not leaf.trainable:
          if (prefix, derived) != ("master", True):
            out.append(())
            continue
          stored, want = "params", False
        name = f"{stored}/{leaf.name}"
        srcs = next(l for l in leaves if l.name == name).sources
        out.append(tuple(restored[f"{name}#{k}"] for k, s in enumerate(srcs)
                         if s.array is not None and s.derived == want))
      return plan.unflatten(out)

    master, params = parts("master", False), parts("master", True)
    opt = target.opt_state
    if isinstance(opt, HostAdamState):
      opt_state = HostAdamState(restored["opt/count#0"], parts("opt/mu", False), parts("opt/nu", False))
    else:
      paths, treedef = jax.tree_util.tree_flatten_with_path(opt)
      opt_state = jax.tree.unflatten(treedef, [
          restored["opt/" + "/".join(key_name(k) for k in path) + "#0"] for path, _ in paths])
    state = TrainState(restored["step#0"], params, master, opt_state, engine, known_step=step)
    return state, meta.get("extra", {})

  def restore_newest(self, model_factory: Callable, tx: optax.GradientTransformation, config,
                     mesh, progress: InitReport | None = None
                     ) -> tuple[Any, dict, list[tuple[int, str]]]:
    """`(state, extra, skipped)`: the newest step that restores (every chunk checked), and
    the newer steps skipped, each with the reason. A checkpoint of another model or optimizer
    is raised at once (an older step would not fit either). `progress`: as `restore`'s."""
    self.wait()  # this Checkpointer's own save in the background is a step to restore
    skipped = [(s, "not committed: a save still being written, or one that did not finish")
               for s in reversed(uncommitted_steps(self.directory, self.all_steps()))]
    for step in reversed(self.all_steps()):
      try:
        state, extra = self.restore(model_factory, tx, config, mesh, step=step, progress=progress)
        return state, extra, skipped
      except CheckpointMismatch:
        raise
      except Exception as e:  # noqa: BLE001  (damage shows as tensorstore, orbax or OS errors)
        skipped.append((step, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"))
    why = "; ".join(f"step {s}: {r}" for s, r in skipped) or "it holds no committed step"
    raise CheckpointError(f"no checkpoint in {self.directory} restores ({why}).")

  def close(self) -> None:
    """Wait for the last save (raising if it failed), then release the directory."""
    try:
      self.wait()
    finally:
      if self._manager is not None:
        self._manager.close()
        self._manager = None
      if self._unlock is not None:
        self._unlock()
        self._unlock = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def uncommitted_steps(directory: str, steps: list[int]) -> list[int]:
  """Steps newer than the last of `steps` whose folders in `directory` are still temporary:
  a save still being written (by another process), or one that did not finish."""
  names = os.listdir(directory) if os.path.isdir(directory) else []
  pending = {int(n.split(".", 1)[0]) for n in names
             if ".orbax-checkpoint-tmp" in n and n.split(".", 1)[0].isdigit()}
  return sorted(s for s in pending if not steps or s > steps[-1])


def read_metadata(directory: str, step: int | None, steps: list[int]) -> dict:
  """The JSON metadata of `step` (default: the latest) of the checkpoint folder `directory`,
  whose committed steps are `steps` (oldest first). Asked for the latest while a newer step
  is not committed, it says so: that step is not read."""
  newer = uncommitted_steps(directory, steps) if step is None else []
  if newer:
    reading = f"reading step {steps[-1]}" if steps else "no step is committed yet"
    warnings.warn(
        f"{directory}: step {newer[-1]} is not committed (a save still being written, or one "
        f"that did not finish); {reading}. To read the step being saved, call the saving run's "
        "Checkpointer.wait() first.", stacklevel=4)
  if not steps:
    raise CheckpointError(f"no checkpoint in {directory}: it holds no committed step.")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise CheckpointError(f"no checkpoint for step {step} in {directory}; saved steps: {steps}.")
  path = os.path.join(directory, str(step), "meta", "metadata")
  try:
    with open(path) as f:
      meta = json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"checkpoint step {step} in {directory} has no readable "
                          f"metadata ({e}); restore another step: {steps}.") from e
  if meta.get("format") != FORMAT:
    raise CheckpointError(f"{path} is not a {FORMAT} checkpoint (format {meta.get('format')!r}).")
  return meta


def _restore_targets(target) -> list[Leaf]:
  """`state_leaves` of an abstract state, with scalars that must come back as arrays."""
  leaves = state_leaves(target)
  whole = NamedSharding(target.engine.mesh, P())
  for leaf in leaves:
    if leaf.name in ("step", "opt/count"):
      src = leaf.sources[0]
      if not isinstance(src.array, jax.ShapeDtypeStruct):
        src.array = jax.ShapeDtypeStruct((), jnp.int32, sharding=whole)
  return leaves


def _model_leaves(shapes: dict[str, list]) -> dict[str, tuple[list, bool]]:
  """A state's model leaves from its listing (name -> shape): bare name -> (shape, trained).
  Trained leaves are listed as their fp32 master, frozen ones as their params."""
  out: dict[str, tuple[list, bool]] = {}
  for prefix, trained in (("params/", False), ("master/", True)):
    out.update((k[len(prefix):], (v, trained)) for k, v in shapes.items() if k.startswith(prefix))
  return out


def _some(names: list[str], shapes: dict[str, tuple[list, bool]]) -> str:
  return f"e.g. {names[0]!r} {shapes[names[0]][0]}" + (" ..." if len(names) > 1 else "")


def _check_compatible(meta: dict, leaves: list[Leaf], directory: str, step: int) -> None:
  """Clear errors when the checkpoint holds another model or another optimizer's state."""
  saved = meta["leaves"]
  wanted = {l.name: (list(l.shape), np.dtype(l.dtype).name) for l in leaves}
  where = f"checkpoint step {step} in {directory}"
  there = _model_leaves({k: v["shape"] for k, v in saved.items()})
  here = _model_leaves({k: v[0] for k, v in wanted.items()})
  only_there, only_here = sorted(set(there) - set(here)), sorted(set(here) - set(there))
  reshaped = sorted(k for k in set(there) & set(here) if there[k][0] != here[k][0])
  found = []
  if only_there:
    found.append(f"{len(only_there)} of its params are not in this model "
                 f"({_some(only_there, there)})")
  if only_here:
    found.append(f"{len(only_here)} of this model's are not in it ({_some(only_here, here)})")
  if reshaped:
    k = reshaped[0]
    found.append(f"{len(reshaped)} have another shape (e.g. {k!r} {there[k][0]} there and "
                 f"{here[k][0]} here)")
  if found:
    lora = any("lora" in k for k in only_there + only_here)
    raise CheckpointMismatch(
        f"{where} was saved from another model: {'; '.join(found)}. "
        + ("Its LoRA adapters differ from this model's: build it with the lora_rank it was "
           "trained with (train_gpt.py: --lora-rank). " if lora else "")
        + "Build the model with the config it was trained with, or use another checkpoint "
        "directory.")
  frozen = sorted(k for k in here if here[k][1] and not there[k][1])
  thawed = sorted(k for k in here if there[k][1] and not here[k][1])
  found = ([f"{len(frozen)} frozen there are trained here ({_some(frozen, here)})"] if frozen
           else []) + ([f"{len(thawed)} trained there are frozen here ({_some(thawed, here)})"]
                       if thawed else [])
  if found:
    raise CheckpointMismatch(
        f"{where} trains other params than this run: {'; '.join(found)}. Restore with the "
        "ZeroConfig.trainable it was saved with.")
  opt_saved = {k for k in saved if k.startswith("opt/")}
  opt_wanted = {k for k in wanted if k.startswith("opt/")}
  if opt_saved != opt_wanted:
    missing = sorted(opt_wanted - opt_saved)[:3]
    raise CheckpointMismatch(
        f"{where} holds another optimizer's state (this run needs {missing} ...). Restore with the "
        "optimizer it was saved with; zinfjax.optim.adamw states restore across device, "
        "pinned_host and nvme, optax states only onto offload_optimizer='device' with the same optax chain.")
  for k in sorted(opt_wanted):
    if saved[k]["shape"] != wanted[k][0]:
      raise CheckpointMismatch(f"{where}: optimizer state {k!r} has shape {saved[k]['shape']} there and "
                            f"{wanted[k][0]} here.")


def _config_json(config) -> dict:
  out = {}
  for f in dataclasses.fields(config):
    v = getattr(config, f.name)
    out[f.name] = v if isinstance(v, (int, float, str, bool, type(None), list)) else str(v)
  return out
