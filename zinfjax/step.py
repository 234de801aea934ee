"""The training step: one builder for every stage and placement, reading the plan.

One jitted program computes the loss and the gradients (`grads.py`), then
updates every optimizer segment held in arrays where it lives (any optax
transformation when the whole optimizer is on the device; else zinfjax's
AdamW: jnp on the device, the C++ kernel on pinned host) and puts the new
compute params on their tiers. The optimizer segments on NVMe are updated by
the host pipeline around the program (`nvme_step.py`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from .grads import (LossFn, local_loss_and_grads, nvme_leaf, param_specs, sum_squares,
                    with_anchors)
from .ordering import needs_order, ordered_collectives
from .offload import swap, tiers
from .optim.host import UPDATES, HostAdamState
from .optim.hyper import clip_scale
from .inputs import shard_batch
from .nvme_step import all_or_nothing, checked, with_pipeline
from .placement import Segment, Tier
from .state import TrainState, gather_params, retuple, untuple

Step = Callable[[TrainState, Any], tuple[TrainState, dict]]
__all__ = ["Step", "make_train_step", "shard_batch", "train_step"]


def _overlap(seg: Segment, start: int, stop: int) -> tuple[int, int]:
  return max(seg.start, start), min(seg.stop, stop)


def make_train_step(state: TrainState, loss_fn: LossFn) -> Step:
  """A jitted `(state, batch) -> (state, metrics)` for `loss_fn(model, local_batch) -> mean loss`.

  `batch` is any pytree of arrays whose leading axis (examples) divides evenly
  over the `data` axis; `loss_fn` sees each rank's slice. The input state is
  donated: use the returned one.
  """
  engine = state.engine
  if loss_fn in engine.steps:
    return engine.steps[loss_fn]
  plan, mesh, axis, store = engine.plan, engine.mesh, engine.plan.axis, engine.store
  hyper, pipeline = engine.hyper, engine.pipeline
  rep, anchor_spec = NamedSharding(mesh, P()), P(axis)
  leaves = plan.leaves
  full_specs, grad_specs = param_specs(plan), param_specs(plan, "grads")
  storage = [plan.spec(l) for l in leaves]
  calls: list[int] = []   # the stacks in the order the forward pass runs them (seen at trace)

  def record(index: int) -> None:
    if index not in calls:
      calls.append(index)

  def shard_map(body, in_specs, out_specs):
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

  def grads_in(grads, ranges):
    """Per leaf, the grads of each layer range as device arrays (NVMe ones read back)."""
    def body(grads):
      rank, out = tiers.rank(axis), []
      for leaf, parts, rs in zip(leaves, plan.flatten(grads), ranges):
        got = []
        for start, stop in rs:
          pieces = []
          for seg, g in zip(leaf.params, parts):
            lo, hi = _overlap(seg, start, stop)
            if lo >= hi:
              continue
            if seg.tier == Tier.NVME:
              sub = nvme_leaf(plan, store, leaf, "grads", Segment(Tier.NVME, lo, hi))
              pieces.append(sub.read_all(g[0, 0].astype(jnp.int32), rank))
            else:
              x = tiers.to_device(g, seg.tier)
              pieces.append(x[lo - seg.start:hi - seg.start] if leaf.stacked else x)
          got.append(pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces))
        out.append(tuple(got))
      return out
    return shard_map(body, (grad_specs,), [tuple(s for _ in rs) for s, rs in zip(storage, ranges)])(grads)

  def place_params(old_params, new: list) -> tuple[Any, jax.Array]:
    """New compute params (per leaf: [(start, stop, device array)]) onto their segments; layers
    no piece covers (updated later by the NVMe pipeline) keep their old values."""
    out, writes = [], []
    for leaf, olds, pieces in zip(leaves, plan.flatten(old_params), new):
      olds, parts = iter(olds), []
      for seg in leaf.params:
        old = None if seg.tier == Tier.NVME else next(olds)
        covered = [(lo, hi, x, a) for a, b, x in pieces for lo, hi in [_overlap(seg, a, b)]
                   if lo < hi]
        if seg.tier == Tier.NVME:
          writes += [(leaf, Segment(Tier.NVME, lo, hi), x[lo - a:hi - a] if leaf.stacked else x)
                     for lo, hi, x, a in covered]
          continue
        chunks, at = [], seg.start
        if len(covered) != 1 or (covered[0][0], covered[0][1]) != (seg.start, seg.stop):
          old = tiers.to_device(old, seg.tier)  # pieced together on the device (out_shardings
                                                # put the result back on its tier)
        for lo, hi, x, a in covered:
          if lo > at:
            chunks.append(old[at - seg.start:lo - seg.start])
          chunks.append(x[lo - a:hi - a] if leaf.stacked else x)
          at = hi
        if at < seg.stop:
          chunks.append(old if at == seg.start else old[at - seg.start:])
        parts.append(chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks))
      out.append(tuple(parts))
    token = None
    if writes:
      def body(*xs):
        rank = tiers.rank(axis)
        tokens = [nvme_leaf(plan, store, leaf, "params", seg).write_all(x, rank)
                  for (leaf, seg, _), x in zip(writes, xs)]
        return sum(tokens).reshape(1)
      token = jnp.sum(shard_map(body, tuple(plan.spec(w[0]) for w in writes), anchor_spec)(
          *[w[2] for w in writes]))
    return plan.unflatten(out), token

  def optax_update(state, grads, norm, ok):
    whole = grads_in(grads, [[(0, l.num_layers)] if l.trainable else [] for l in leaves])
    g32 = plan.unflatten([g[0].astype(jnp.float32) if g else None for g in whole])
    def apply(g32, opt_state, master):
      updates, opt_state = engine.tx.update(g32, opt_state, master)
      return optax.apply_updates(master, updates), opt_state

    args = (g32, state.opt_state, untuple(plan, state.master))
    # a skipped step does not run the update (a selection after it would keep old and new
    # states alive together: more memory than the step's own temporaries)
    master, opt_state = apply(*args) if ok is None else jax.lax.cond(
        ok, apply, lambda g, o, m: (m, o), *args)
    new = [[(0, l.num_layers, m.astype(plan.compute_dtype))] if m is not None else []
           for l, m in zip(leaves, plan.flatten(master))]
    return retuple(plan, master), opt_state, new

  def adamw_update(state, grads, norm, ok):
    ranges = [[(s.start, s.stop) for s in l.optimizer if s.tier != Tier.NVME] for l in leaves]
    count = state.opt_state.count
    new_count = count + 1 if ok is None else count + ok.astype(count.dtype)
    if not any(ranges):  # every optimizer state on NVMe: the pipeline updates them all
      return state.master, HostAdamState(new_count, state.opt_state.mu, state.opt_state.nu), [
          [] for _ in leaves]
    got = grads_in(grads, ranges)
    clip = clip_scale(norm, hyper.max_grad_norm)
    scalars = hyper.scalars(count) + (() if ok is None else (ok,))
    opt = state.opt_state
    flat = [plan.flatten(t) for t in (state.master, opt.mu, opt.nu)]
    jobs = [(i, j, s.tier) for i, l in enumerate(leaves) for j, s in enumerate(l.array_segments("master"))]
    specs = tuple(storage[i] for i, _, _ in jobs)

    def body(scalars, *xs):
      n = len(jobs)
      ms, mus, nus, gs = (list(xs[k * n:(k + 1) * n]) for k in range(4))
      outs = [None] * n
      for tier, update in UPDATES.items():
        idx = [k for k, job in enumerate(jobs) if job[2] == tier]
        res = update(hyper, [engine.decays[jobs[k][0]] for k in idx], scalars, *(
            [arr[k] for k in idx] for arr in (ms, mus, nus, gs)), plan.compute_dtype,
            platform=mesh.devices.flat[0].platform)
        for r, k in enumerate(idx):
          outs[k] = tuple(x[r] for x in res)
      return tuple(tuple(o) for o in outs)

    grads_jobs = [got[i][j] for i, j, _ in jobs]
    if clip is not None:
      grads_jobs = [clip(g) for g in grads_jobs]
    res = shard_map(body, (P(),) + specs * 4, tuple((s,) * 4 for s in specs))(
        scalars, *[flat[0][i][j] for i, j, _ in jobs], *[flat[1][i][j] for i, j, _ in jobs],
        *[flat[2][i][j] for i, j, _ in jobs], *grads_jobs)
    trees = [[list(parts) for parts in f] for f in flat]
    new = [[] for _ in leaves]
    for (i, j, _), (m, mu, nu, p) in zip(jobs, res):
      for t, x in zip(trees, (m, mu, nu)):
        t[i][j] = x
      seg = leaves[i].array_segments("master")[j]
      new[i].append((seg.start, seg.stop, p))
    master, mu, nu = (plan.unflatten([tuple(p) for p in t]) for t in trees)
    return master, HostAdamState(new_count, mu, nu), new

  host_grads = pipeline is not None and not pipeline.grads_all_on_nvme

  def step(state: TrainState, batch: Any):
    def local(p, b):
      loss, grads = local_loss_and_grads(engine, loss_fn, p, b, record)
      return loss, grads, sum_squares(plan, grads)

    if needs_order(mesh, engine.config.ordered_collectives):
      local = ordered_collectives(local)
    fn = shard_map(local, (full_specs, P(axis)), (P(), grad_specs, P()))
    loss, grads, squares = fn(with_anchors(plan, state.params), batch)
    norm = jnp.sqrt(squares)
    ok = jnp.isfinite(norm) if engine.config.skip_nonfinite else None
    update = optax_update if hyper is None else adamw_update
    master, opt_state, new = update(state, grads, norm, ok)
    if plan.stage == 3:
      params, token = place_params(state.params, new)
    else:
      params, token = gather_params(plan, master, engine.config.ordered_collectives), None
    metrics = {"loss": loss, "grad_norm": norm}
    if ok is not None:
      metrics["skipped"] = jnp.logical_not(ok).astype(jnp.int32)
    # zinfjax's AdamW: the schedule at the count before the step; optax's injected
    # hyperparameters: those the update just used
    lr = learning_rate(engine, state.opt_state if hyper is not None else opt_state)
    if lr is not None:
      metrics["lr"] = lr
    if token is not None:
      metrics["nvme_token"] = token
    kept = plan.unflatten([tuple(g for s, g in zip(l.params, parts) if s.tier != Tier.NVME)
                           for l, parts in zip(leaves, plan.flatten(grads))]) if host_grads else None
    return TrainState(state.step + 1, params, master, opt_state, engine), metrics, kept

  shardings = jax.tree.map(lambda x: x.sharding, state)
  grad_shardings = (None if not host_grads else plan.unflatten([
      tuple(x.sharding for x in parts) if leaf.trainable else ()
      for leaf, parts in zip(leaves, plan.flatten(state.params))]))
  jitted = jax.jit(step, donate_argnums=(0,), out_shardings=(shardings, rep, grad_shardings),
                   in_shardings=(shardings, NamedSharding(mesh, P(axis))),
                   compiler_options=swap.compiler_options(mesh) if store is not None else None)
  if pipeline is None:
    def run(state, batch):
      new, metrics, _ = checked(engine, jitted(state, shard_batch(engine, batch)))
      return new, metrics
  else:
    run = with_pipeline(engine, jitted, calls)
  if store is not None and engine.config.nvme_atomic_steps:
    run = all_or_nothing(engine, run)
  guarded = consuming(run)
  guarded.jitted = jitted
  engine.steps[loss_fn] = guarded
  return guarded


def consuming(run: Step) -> Step:
  """`run`, refusing a state that is no longer usable and marking the one it consumes."""
  def step(state: TrainState, batch: Any) -> tuple[TrainState, dict]:
    state.check_usable("train_step")
    try:
      new, metrics = run(state, batch)
    except BaseException:
      if state.arrays_deleted():
        state.mark_donated(None)  # the program ran (and took the arrays) before it failed
      raise
    state.mark_donated(new)
    return new, metrics

  return step


def learning_rate(engine, opt_state) -> jax.Array | None:
  """The learning rate this step uses: zinfjax's AdamW schedule at the step's count, or an
  optax `inject_hyperparams` state's `learning_rate` (None when the optimizer hides it)."""
  if engine.hyper is not None:
    return jnp.asarray(engine.hyper.schedule(opt_state.count), jnp.float32)
  found = [s.hyperparams["learning_rate"] for s in jax.tree.leaves(
      opt_state, is_leaf=lambda x: hasattr(x, "hyperparams"))
           if hasattr(s, "hyperparams") and "learning_rate" in s.hyperparams]
  return jnp.asarray(found[0], jnp.float32) if found else None


def train_step(state: TrainState, batch: Any, loss_fn: LossFn) -> tuple[TrainState, dict]:
  """One ZeRO training step; compiles once per (loss_fn, shapes) and reuses it."""
  return make_train_step(state, loss_fn)(state, batch)
