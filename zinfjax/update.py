"""The update half of a step's program: optimizer segments held in arrays, then the new params.

Plain functions of the engine, the step's `Timeline` and the arrays, called
by `step.train_program` after the loss and grads. Each reads the moves it
makes from the timeline and the operations on a segment from `tiers.ops`:

* `optax_update`: any optax transformation, when the whole optimizer is on
  the device;
* `adamw_update`: zinfjax's AdamW on every optimizer segment held in arrays
  (jnp on the device, the C++ kernel on pinned host); NVMe segments are the
  host pipeline's (`runner.py`);
* `place_params`: the new compute params onto their tiers (NVMe ones
  written from the program); layers the pipeline updates keep their old
  values until it merges its own.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from .grads import param_specs
from .offload import tiers
from .optim.host import HostAdamState, updates
from .optim.hyper import clip_scale
from .placement import Plan
from .schedule import Phase, Timeline
from .state import TrainState, retuple, untuple

Pieces = list[list[tuple[int, int, jax.Array]]]  # per leaf: (start, stop, new device array)


def shard_map(plan: Plan, body, in_specs, out_specs):
  return jax.shard_map(body, mesh=plan.mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=False)


def grads_in(engine, grads: Any, ranges: list[list[tuple[int, int]]]) -> list[tuple]:
  """Per leaf, the grads of each layer range as device arrays (from whichever tier holds them)."""
  plan, store = engine.plan, engine.store
  specs = [plan.spec(l) for l in plan.leaves]

  def body(grads):
    rank, out = tiers.rank(plan.axis), []
    for leaf, parts, rs in zip(plan.leaves, plan.flatten(grads), ranges):
      got = []
      for start, stop in rs:
        pieces = [tiers.ops(plan, store, leaf, "grads", seg).fetch(g, lo, hi, rank)
                  for seg, g in zip(leaf.params, parts)
                  for lo, hi in [(max(seg.start, start), min(seg.stop, stop))] if lo < hi]
        got.append(pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces))
      out.append(tuple(got))
    return out

  in_specs = (param_specs(plan, "grads"),)
  return shard_map(plan, body, in_specs, [tuple(s for _ in rs) for s, rs in zip(specs, ranges)])(
      grads)


def optax_update(engine, state: TrainState, grads: Any, norm, ok) -> tuple[Any, Any, Pieces]:
  """`engine.tx` over the whole fp32 master on the device (no update where `ok` is False)."""
  plan = engine.plan
  whole = grads_in(engine, grads, [[(0, l.num_layers)] if l.trainable else [] for l in plan.leaves])
  g32 = plan.unflatten([g[0].astype(jnp.float32) if g else None for g in whole])

  def apply(g32, opt_state, master):
    updates, opt_state = engine.tx.update(g32, opt_state, master)
    return optax.apply_updates(master, updates), opt_state

  args = (g32, state.opt_state, untuple(plan, state.master))
  master, opt_state = unless_skipped(ok, apply, args, lambda g, o, m: (m, o),
                                     plan.mesh.devices.flat[0].platform)
  new = [[(0, l.num_layers, m.astype(plan.compute_dtype))] if m is not None else []
         for l, m in zip(plan.leaves, plan.flatten(master))]
  return retuple(plan, master), opt_state, new


def unless_skipped(ok, update, args: tuple, keep, platform: str) -> Any:
  """`update(*args)`, or `keep(*args)` (the states as they were) where `ok` is False (None:
  always the update), in the form each compiler keeps in place. XLA:CPU: a `lax.cond` (a
  selection after the update keeps old and new states alive together). XLA:GPU: that
  selection, which it fuses into the update (around a `lax.cond` it copies every state, each
  step)."""
  if ok is None:
    return update(*args)
  if platform == "cpu":
    return jax.lax.cond(ok, update, keep, *args)
  return jax.tree.map(lambda new, old: jnp.where(ok, new, old), update(*args), keep(*args))


def adamw_update(engine, timeline: Timeline, state: TrainState, grads: Any, norm,
                 ok) -> tuple[Any, HostAdamState, Pieces]:
  """zinfjax's AdamW on the optimizer segments the program updates (the timeline's), on each
  rank's shards where they live; the count advances unless `ok` is False."""
  plan, hyper = engine.plan, engine.hyper
  leaves = plan.leaves
  ranges = timeline.program_updates(len(leaves))
  count = state.opt_state.count
  new_count = count + 1 if ok is None else count + ok.astype(count.dtype)
  if not any(ranges):  # every optimizer state on NVMe: the pipeline updates them all
    return state.master, HostAdamState(new_count, state.opt_state.mu, state.opt_state.nu), [
        [] for _ in leaves]
  got = grads_in(engine, grads, ranges)
  scalars = hyper.scalars(count) + (() if ok is None else (ok,))
  opt = state.opt_state
  flat = [plan.flatten(t) for t in (state.master, opt.mu, opt.nu)]
  jobs = [(i, j, s.tier) for i, l in enumerate(leaves)
          for j, s in enumerate(l.array_segments("master"))]
  specs = tuple(plan.spec(leaves[i]) for i, _, _ in jobs)
  platform = plan.mesh.devices.flat[0].platform

  def body(scalars, norm, *xs):
    n = len(jobs)
    ms, mus, nus, gs = (list(xs[k * n:(k + 1) * n]) for k in range(4))
    clip = clip_scale(norm, hyper.max_grad_norm)  # each update clips its grads (None: no limit)
    outs = [None] * n
    for tier, update in updates(engine.config.host_optimizer).items():
      idx = [k for k, job in enumerate(jobs) if job[2] == tier]
      res = update(hyper, [engine.decays[jobs[k][0]] for k in idx], scalars, *(
          [arr[k] for k in idx] for arr in (ms, mus, nus, gs)), plan.compute_dtype,
          platform=platform, stacked=[leaves[jobs[k][0]].stacked for k in idx], clip=clip)
      for r, k in enumerate(idx):
        outs[k] = tuple(x[r] for x in res)
    return tuple(tuple(o) for o in outs)

  grads_jobs = [got[i][j] for i, j, _ in jobs]
  res = shard_map(plan, body, (P(), P()) + specs * 4, tuple((s,) * 4 for s in specs))(
      scalars, norm, *[flat[k][i][j] for k in range(3) for i, j, _ in jobs], *grads_jobs)
  trees = [[list(parts) for parts in f] for f in flat]
  new: Pieces = [[] for _ in leaves]
  for (i, j, _), (m, mu, nu, p) in zip(jobs, res):
    for t, x in zip(trees, (m, mu, nu)):
      t[i][j] = x
    seg = leaves[i].array_segments("master")[j]
    new[i].append((seg.start, seg.stop, p))
  master, mu, nu = (plan.unflatten([tuple(p) for p in t]) for t in trees)
  return master, HostAdamState(new_count, mu, nu), new


def place_params(engine, timeline: Timeline, old_params: Any, new: Pieces) -> tuple[Any, Any]:
  """The timeline's "after" moves the program makes: the new compute params (`new`, per leaf)
  onto their segments, NVMe ones written (a token for the writes, or None). Layers the
  pipeline updates keep their old values here."""
  plan, store = engine.plan, engine.store
  out, writes = [], []
  for leaf, olds, pieces in zip(plan.leaves, plan.flatten(old_params), new):
    moves = [m for m in timeline.select(Phase.AFTER, leaf=leaf.index) if m.in_program]
    take = lambda m: next(x[m.start - a:m.stop - a] if leaf.stacked else x
                          for a, b, x in pieces if a <= m.start and m.stop <= b)
    olds, parts = iter(olds), []
    for seg in leaf.params:
      ops = tiers.ops(plan, store, leaf, "params", seg)
      mine = [m for m in moves if m.dst == seg.tier and seg.start <= m.start < seg.stop]
      if not seg.tier.holds_arrays:
        writes += [(leaf, ops, m, take(m)) for m in mine]
        continue
      old = next(olds)
      if [(m.start, m.stop) for m in mine] == [(seg.start, seg.stop)]:
        parts.append(take(mine[0]))  # out_shardings put it back on its tier
        continue
      old = ops.fetch(old, seg.start, seg.stop, None)  # pieced together on the device
      chunks, at = [], seg.start
      for m in mine:
        if m.start > at:
          chunks.append(old[at - seg.start:m.start - seg.start])
        chunks.append(take(m))
        at = m.stop
      if at < seg.stop:
        chunks.append(old if at == seg.start else old[at - seg.start:])
      parts.append(chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks))
    out.append(tuple(parts))
  token = None
  if writes:
    def body(*xs):
      rank = tiers.rank(plan.axis)
      return sum(ops.put(x, m.start, m.stop, rank) for (_, ops, m, _), x in zip(writes, xs)
                 ).reshape(1)
    token = jnp.sum(shard_map(plan, body, tuple(plan.spec(w[0]) for w in writes), P(plan.axis))(
        *[w[3] for w in writes]))
  return plan.unflatten(out), token
