"""The plain references a fuzzed zinfjax run is compared with (`scripts/fuzz_configs.py`):
optax's AdamW on one device, one fed some parts' grads a step late, and the tolerances."""

from __future__ import annotations

from typing import NamedTuple


class Tolerance(NamedTuple):
  """How far a run may be from its reference (`compare`)."""

  loss: float  # relative, every step
  leaf: float  # a leaf's mean error over the mean change training made
  init: float  # of the leaf's mean size, added to that change
  element: float  # absolute, any one element

  @property
  def init_rtol(self) -> float:
    """`init` as `measure` takes it: a fraction of the leaf's size counted as change."""
    return self.init / self.leaf if self.leaf else 0.0


# fp32 in another summation order: losses to 2e-5; in each param leaf, the mean error to 1e-3
# of the mean change training made (plus 1e-6 of the leaf's mean size: zinfjax draws the
# initial params in a compiled program, a few units in the last place from nnx's eager ones,
# which a frozen leaf keeps), and no element off by more than 1e-4 (a fortieth of one step at
# the peak learning rate: an element whose grads stay near zero moves by Adam's sign of them,
# which that order can flip)
FP32 = Tolerance(loss=2e-5, leaf=1e-3, init=1e-6, element=1e-4)
# bf16 against zinfjax's own all-device run: exact where both run the same update program;
# elsewhere (the host's C++ or XLA AdamW against the step's) a unit in the last place of an
# fp32 master can round a bf16 param the other way, and Adam's sign of near-zero grads turns
# that into whole steps: 72 drawn trials (GPT and Llama, LoRA, NaN steps) saw losses within
# 2.2e-5, leaves within 0.26 of their change, elements within 1.3e-2. Bugs of the kind this
# run looks for (a layer's params a step stale, the wrong layer's states) move the losses by
# 1e-3 and more.
BF16 = Tolerance(loss=2e-4, leaf=0.5, init=1e-6, element=3e-2)
# a ZeRO-3 run that differs from its twin only in where the params live: the same bits
EXACT = Tolerance(loss=0.0, leaf=0.0, init=0.0, element=0.0)

STACKS = ("blocks", "layers")  # the stacked layers' attribute in GPT and in Llama
# `ZeroConfig.trainable` by name: which params train (the others stay frozen)
TRAINABLE = {
    "blocks": lambda path, _: bool(set(STACKS) & set(map(str, path))),  # not embeddings, norm
    "no_norms": lambda path, _: not any(str(p).startswith("ln") for p in path),
}


def trainable_filter(name: str | None):
  """`ZeroConfig.trainable` of a trial (None: every param)."""
  from flax import nnx
  return nnx.LoRAParam if name == "lora" else TRAINABLE.get(name)


def wrt(name: str | None):
  """The nnx filter of the params a trial trains (every `nnx.Param`, or those of `name`)."""
  from flax import nnx
  return nnx.Param if name is None else nnx.All(nnx.Param, trainable_filter(name))


def schedule():
  import optax
  return optax.linear_schedule(1e-3, 4e-3, 4)  # the step count matters: a skip must not advance it


def reference_tx(clip):
  import optax
  adamw = optax.adamw(schedule(), weight_decay=0.1)
  return adamw if clip is None else optax.chain(optax.clip_by_global_norm(clip), adamw)


def scaled_loss(model, batch):
  """The LM loss times the batch's `scale` (NaN in one step with --nan)."""
  from zinfjax.models import lm_loss
  return lm_loss(model, batch) * batch["scale"][0]


def param_leaves(model) -> list:
  """Every `nnx.Param` of `model` as numpy arrays, in tree order (what `compare` takes)."""
  import jax
  import numpy as np
  from flax import nnx
  return [np.asarray(x) for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))]


def initial_params(make_model) -> list:
  """The params nnx draws for the model on one device (the leaves of `reference`'s start)."""
  import jax
  from flax import nnx
  with jax.default_device(jax.devices()[0]):
    return param_leaves(make_model(nnx.Rngs(jax.random.key(0))))


def reference(make_model, clip, data, nan_step, trainable=None, jitter: int | None = None):
  """Losses, initial and final params of optax on one device, training the params
  `trainable` names; the NaN step is skipped (its loss kept). With `jitter` (a seed), every
  initial param is first moved by one unit in the last place, up or down at random: the
  model's own sensitivity to rounding (see `calibrated`)."""
  import jax
  import numpy as np
  from flax import nnx
  with jax.default_device(jax.devices()[0]):
    model = make_model(nnx.Rngs(jax.random.key(0)))
    initial = param_leaves(model)
    if jitter is not None:
      rng = np.random.default_rng(jitter)
      away = lambda x: jax.numpy.asarray(np.nextafter(np.asarray(x), np.where(
          rng.random(x.shape) < 0.5, -np.inf, np.inf).astype(x.dtype)))
      nnx.update(model, jax.tree.map(away, nnx.state(model, nnx.Param)))
    optimizer = nnx.Optimizer(model, reference_tx(clip), wrt=wrt(trainable))

    @nnx.jit(static_argnames="apply")
    def step(model, optimizer, batch, apply):
      diff = nnx.DiffState(0, wrt(trainable))
      loss, grads = nnx.value_and_grad(scaled_loss, argnums=diff)(model, batch)
      if apply:
        optimizer.update(model, grads)
      return loss

    losses = [float(step(model, optimizer, b, apply=i != nan_step)) for i, b in enumerate(data)]
    return np.asarray(losses), initial, param_leaves(model)


def delayed_reference(make_model, clip, data, trainable, delayed: dict[str, set[int]]):
  """`reference` where the parts `delayed` names see each step's grads one step late."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  with jax.default_device(jax.devices()[0]):
    model = make_model(nnx.Rngs(jax.random.key(0)))
    initial = param_leaves(model)
    graphdef, everything = nnx.split(model)
    params = nnx.to_pure_dict(nnx.state(model, wrt(trainable)))
    base = nnx.to_pure_dict(everything)

    def overlay(d, p):  # `d` with the trained params `p` in place of its own
      return {k: overlay(v, p[k]) if isinstance(v, dict) and k in p else p.get(k, v)
              for k, v in d.items()}

    def loss(p, base, batch):
      s = jax.tree.map(lambda x: x, everything)
      nnx.replace_by_pure_dict(s, overlay(base, p))
      return scaled_loss(nnx.merge(graphdef, s), batch)

    def late_mask(path, x):  # a stacked leaf's delayed layers, or the whole leaf
      layers = delayed.get("/".join(str(k.key) for k in path), set())
      if x.ndim and str(path[0].key) in STACKS:
        return jnp.asarray([i in layers for i in range(x.shape[0])]).reshape(
            (-1,) + (1,) * (x.ndim - 1))
      return jnp.asarray(bool(layers))

    mask = jax.tree_util.tree_map_with_path(late_mask, params)
    grad, tx = jax.jit(jax.value_and_grad(loss)), reference_tx(clip)
    now, late, held, losses = tx.init(params), tx.init(params), None, []
    for batch in data:
      value, g = grad(params, base, batch)
      losses.append(float(value))
      u_now, now = tx.update(g, now, params)
      u_late = jax.tree.map(jnp.zeros_like, g)
      if held is not None:
        u_late, late = tx.update(held, late, params)
      params = jax.tree.map(lambda p, m, a, b: p + jnp.where(m, b, a), params, mask, u_now, u_late)
      held = g
    nnx.replace_by_pure_dict(everything, overlay(base, params))
    nnx.update(model, everything)
    return np.asarray(losses), initial, param_leaves(model)


def measure(losses, params, want_losses, initial, want_params, init_rtol: float) -> dict:
  """The worst of each measure: losses' relative error, a leaf's mean error over the change
  training made (plus `init_rtol` of its mean size), one element's error."""
  import numpy as np
  got, want = np.asarray(losses), np.asarray(want_losses)
  both = np.isfinite(got) & np.isfinite(want)
  worst = {"loss": float(np.max(np.abs(got - want)[both] / np.abs(want)[both], initial=0.0))
           if np.array_equal(np.isfinite(got), np.isfinite(want)) else float("inf"),
           "leaf": 0.0, "element": 0.0, "at": None}
  for i, (a, b, b0) in enumerate(zip(params, want_params, initial)):
    change, size = np.mean(np.abs(b - b0)), np.mean(np.abs(b))
    leaf = float(np.mean(np.abs(a - b)) / max(change + init_rtol * size, 1e-30))
    element = float(np.max(np.abs(a - b), initial=0.0))
    if leaf > worst["leaf"] or element > worst["element"]:
      worst["at"] = f"leaf {i} {b.shape}"
    worst["leaf"], worst["element"] = max(worst["leaf"], leaf), max(worst["element"], element)
  return worst


def calibrated(tol: Tolerance, want, make_model, clip, data, nan_step, trainable=None,
               draws: int = 2, more: int = 4) -> tuple[Tolerance, dict]:
  """`tol` widened, measure by measure, to twice the farthest the reference `want` is from
  itself started one unit in the last place away: a model whose fp32 training amplifies
  rounding (OLMo 2's norms on the MLP's small outputs) differs that much from itself whatever
  computes it. `draws` starts; where they move an element by a tenth of `tol` or more (a
  model that amplifies), `more` besides: how far it moves varies tenfold from one start to
  the next. Returns that farthest distance too."""
  floor = lambda k: measure(*reference(make_model, clip, data, nan_step, trainable,
                                       jitter=k)[::2], *want, tol.init_rtol)
  floors = [floor(k) for k in range(draws)]
  if max(f["element"] for f in floors) >= tol.element / 10:
    floors += [floor(k) for k in range(draws, draws + more)]
  worst = {m: max(f[m] for f in floors) for m in ("loss", "leaf", "element")}
  return tol._replace(loss=max(tol.loss, 2 * worst["loss"]), leaf=max(tol.leaf, 2 * worst["leaf"]),
                      element=max(tol.element, 2 * worst["element"])), worst


def compare(losses, params, want_losses, initial, want_params, tol: Tolerance = FP32
            ) -> str | None:
  """None when they agree to `tol`; else what differs."""
  worst = measure(losses, params, want_losses, initial, want_params, tol.init_rtol)
  if worst["loss"] > tol.loss:
    return f"losses {list(losses)} != {list(want_losses)}"
  if worst["leaf"] > tol.leaf or worst["element"] > tol.element:
    return (f"param {worst['at']}: off by {worst['leaf']:.2e} of the change training made, "
            f"one element by {worst['element']:.2e}")
  return None
