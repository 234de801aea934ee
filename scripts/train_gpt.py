"""Train a GPT with zinfjax ZeRO on a text file or a token file (.bin, .npy), or fine-tune a
Hugging Face checkpoint (Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo 2, GPT-2).

  python scripts/train_gpt.py --preset tiny --zero-stage 3 --steps 200 --devices 8
  python scripts/train_gpt.py --init-from HF_FOLDER --data tokens.bin --export OUT_FOLDER

With no accelerator, `--devices N` runs on N host (CPU) devices (per process).
Checkpoints: `--checkpoint-dir D --save-every N` (the last step is saved too, with
no --save-every alone), and `--resume` to continue from the latest one in D.
Several processes: `scripts/launch.py --nproc N scripts/train_gpt.py ...` (or
`--distributed` under a cluster launcher).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _train_args import (check_args, check_metrics_file, check_no_resave, lr_schedule,  # noqa: E402
                         model_flops, parse_args)

if TYPE_CHECKING:
  from zinfjax.progress import HostMemoryWatch

MAX_SKIPPED = 3  # steps in a row with non-finite grads before the run counts as diverged


def peak_hbm() -> int | None:
  """Peak memory of this process's busiest device in bytes (None where none is kept: CPU)."""
  import jax
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
  return max((p for p in peaks if p is not None), default=None)


def interrupt_at_step_end() -> list:
  """Ctrl-C (SIGINT) ends the run at the next step boundary, not wherever it lands (inside the
  runtime, or a garbage-collection callback that would swallow the KeyboardInterrupt); a second
  Ctrl-C stops at once. Returns the flag the loop checks (non-empty once asked)."""
  stop: list = []

  def handler(signum, frame):
    if stop:
      raise KeyboardInterrupt
    stop.append(signum)
    print("\nCtrl-C: stopping after this step (Ctrl-C again to stop at once)", file=sys.stderr,
          flush=True)

  signal.signal(signal.SIGINT, handler)
  return stop


def split_held_out(tokens, seq_len: int, args):
  """The training tokens and the held-out batch (--eval-every), refused now when the data is
  too short for one sequence (or for a held-out batch besides)."""
  from zinfjax.models import TokenDataset
  need = seq_len + 2
  if len(tokens) < need:
    raise SystemExit(f"error: --data {args.data} has {len(tokens):,} tokens, fewer than one "
                     f"sequence needs ({need:,} for --seq-len {seq_len}); give more data or a "
                     "shorter --seq-len.")
  if not args.eval_every:
    return tokens, None
  cut = len(tokens) - max(len(tokens) // 10, args.batch_size * (seq_len + 1) + 1)
  if cut < need:
    raise SystemExit(f"error: --eval-every holds out {len(tokens) - cut:,} of the {len(tokens):,}"
                     f" tokens of --data {args.data}, leaving too few to train on; give more data"
                     " or leave --eval-every out.")
  held_out = TokenDataset(tokens[cut:], seq_len, args.batch_size, seed=args.seed + 1).at(0)
  return tokens[:cut], held_out


def finetune_tokens(data: str, folder: str, vocab: int, load_tokens):
  """Token ids of `data` for a pretrained model: a uint16 .bin or a .npy as is, or text
  through the checkpoint's tokenizer.json (needs the `tokenizers` package)."""
  import numpy as np
  if data.endswith((".bin", ".npy")):
    return load_tokens(data, vocab)[0]
  path = os.path.join(folder, "tokenizer.json")
  try:
    from tokenizers import Tokenizer
  except ImportError:
    Tokenizer = None
  if not os.path.exists(path) or Tokenizer is None:
    raise ValueError(f"--data {data} is text, which needs the model's tokenizer: "
                     + ("install the `tokenizers` package" if os.path.exists(path) else
                        f"{folder} has no tokenizer.json")
                     + ", or give token ids made with it (a uint16 .bin or a .npy).")
  with open(data, encoding="utf-8") as f:
    ids = np.asarray(Tokenizer.from_file(path).encode(f.read()).ids, np.int32)
  if len(ids) and int(ids.max()) >= vocab:  # a token the tokenizer added past the model's table
    raise ValueError(f"{path} encodes {data} with token id {int(ids.max())}, past the model's "
                     f"vocabulary of {vocab} ids: the tokenizer does not belong to {folder}'s "
                     "model, or adds tokens its embedding lacks.")
  return ids


def same_model(saved: dict | None, config, directory: str) -> None:
  """Refuse a checkpoint whose run saved another model config than this one's (a field it does
  not name, one newer than it, has its default there); compared as the checkpoint stores them,
  in JSON (a tuple, Gemma 3's layer_types, is a list there)."""
  plain = lambda x: json.loads(json.dumps(x))
  here = plain(dataclasses.asdict(config))
  defaults = plain({f.name: f.default for f in dataclasses.fields(config)})
  saved = None if saved is None else {**defaults, **saved}
  if saved is not None and saved != here:
    diff = ", ".join(f"{k} {saved.get(k)} there, {here.get(k)} here"
                     for k in sorted(set(saved) | set(here)) if saved.get(k) != here.get(k))
    raise SystemExit(f"error: the checkpoint in {directory} was trained with another model "
                     f"({diff}); resume with the flags it was saved with.")


def main(argv=None) -> int:
  args = parse_args(argv, __doc__)
  check_args(args)
  if args.devices:  # must happen before jax is imported; ignored by GPU/TPU backends
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"

  import jax
  from zinfjax import distributed
  from zinfjax.checkpoint import CheckpointError
  from zinfjax.offload import CorruptShardError, EngineError, MissingShardError, NoSpaceError
  from zinfjax.progress import HostMemoryWatch

  # the engine's errors already name the file and the fix: one line for the user, no traceback
  engine_errors = (EngineError, NoSpaceError, CorruptShardError, MissingShardError, CheckpointError)
  sys.excepthook = lambda kind, e, tb: (print(f"error: {e}", file=sys.stderr)
                                        if issubclass(kind, engine_errors)
                                        else sys.__excepthook__(kind, e, tb))

  distributed.initialize(auto=args.distributed)
  main_process = jax.process_index() == 0
  say = print if main_process else (lambda *a, **k: None)
  # the least RAM left in each step's record, and a line when it runs low (init's too): a run
  # the kernel kills for memory says how close it came, and where
  with HostMemoryWatch(lambda line: say(line, flush=True)) as watch:  # closed on every way out
    return train(args, say, main_process, watch)


def train(args: argparse.Namespace, say: Callable[..., None], main_process: bool,
          watch: HostMemoryWatch) -> int:
  """The run, from the data to the export; `watch` samples the RAM left throughout."""
  import jax
  import optax
  import zinfjax
  from flax import nnx
  from zinfjax.checkpoint import CheckpointError, Checkpointer, CheckpointParams
  from zinfjax.memory import tier_bytes
  from zinfjax.models import GPT, TokenDataset, get_config, hf, lm_loss, load_tokens
  from zinfjax.offload.mixed import used_by_medium
  from zinfjax.autoplace import need
  from zinfjax.engine import build_engine
  from zinfjax.progress import Progress, human_bytes, init_line, parse_budgets, peak_rss

  args.resume = args.resume or args.resume_step is not None
  if args.lora_rank and not args.init_from:
    raise SystemExit("error: --lora-rank adapts a pretrained model: give --init-from HF_FOLDER.")
  if (args.save_every or args.resume) and not args.checkpoint_dir:
    raise SystemExit("error: --save-every, --resume and --resume-step need --checkpoint-dir.")
  check_metrics_file(args)
  if args.export and jax.process_count() > 1 and not args.checkpoint_dir:
    raise SystemExit(f"error: --export with {jax.process_count()} processes writes the model from "
                     "the checkpoint of the last step (each process holds only its own shards): "
                     "give --checkpoint-dir, on storage every process writes to.")
  weights = None
  try:
    if args.init_from:
      config, model_factory, weights = hf.load(args.init_from)
      if args.lora_rank:
        config = config.replace(lora_rank=args.lora_rank)
        model_factory = hf.factory(config)
      tokens = finetune_tokens(args.data, args.init_from, config.vocab_size, load_tokens)
      seq_len = args.seq_len or min(config.seq_len, 1024)
      if seq_len > config.seq_len:
        raise ValueError(f"--seq-len {seq_len} is longer than the model's {config.seq_len}.")
      name = f"{hf.family(hf.read_config(args.init_from))} from {args.init_from}"
    else:
      tokens, vocab = load_tokens(args.data)
      config = get_config(args.preset, num_layers=args.layers, hidden=args.hidden,
                          num_heads=args.heads, seq_len=args.seq_len, vocab_size=vocab)
      model_factory = lambda rngs: GPT(config, rngs=rngs)
      seq_len, name = config.seq_len, f"GPT {args.preset}"
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"error: {e}") from None
  vocab = config.vocab_size
  tokens, held_out = split_held_out(tokens, seq_len, args)
  try:
    zero = zinfjax.ZeroConfig(
        stage=args.zero_stage, precision=args.precision, prefetch_depth=args.prefetch_depth,
        tiles=args.tiles, offload_param=args.offload_param, offload_grad=args.offload_grad,
        offload_optimizer=args.offload_optimizer,
        nvme_path=args.nvme_path[0] if args.nvme_path and len(args.nvme_path) == 1 else args.nvme_path,
        pinned_budget=args.pinned_budget << 20, nvme_prefetch_depth=args.nvme_prefetch_depth,
        nvme_io_threads=args.nvme_io_threads, nvme_atomic_steps=not args.no_atomic_steps,
        host_optimizer=args.host_optimizer, host_atomic_steps=args.host_atomic_steps,
        delay_update=args.delay_update,
        offload_activations=args.offload_activations, micro_batches=args.micro_batches,
        ordered_collectives={"auto": None, "ordered": True, "unordered": False}[args.collectives],
        trainable=nnx.LoRAParam if args.lora_rank else None, offload=args.offload,
        tier_budgets=parse_budgets(args.budget) or None if args.offload else None)
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  mesh = zinfjax.make_mesh()
  moments = "bfloat16" if args.bf16_moments else "float32"
  auto = None
  if zero.offload == "auto":  # the tiers from the budgets, once, before anything is allocated
    try:
      auto = build_engine(model_factory, zinfjax.optim.adamw(1e-3, moment_dtype=moments), zero,
                          mesh, open_store_=False).auto
    except ValueError as e:
      raise SystemExit(f"error: {e}") from None
    zero = auto.resolve(zero)
  dp = mesh.shape[zero.axis]
  if args.batch_size % (dp * zero.micro_batches):
    raise SystemExit(f"error: --batch-size {args.batch_size} is not divisible by {dp} devices x "
                     f"{zero.micro_batches} micro-batches; use a multiple of "
                     f"{dp * zero.micro_batches}.")
  schedule, clip = lr_schedule(args), args.clip or None
  # zinfjax's AdamW on every tier (jnp on the device, the C++ kernel on the host, the NVMe
  # pipeline): one optimizer state format, so a checkpoint resumes onto any placement; weight
  # decay on the weight matrices, not on biases and norm scales
  decay = dict(weight_decay=args.weight_decay, mask=zinfjax.optim.decay_matrices)
  tx = zinfjax.optim.adamw(schedule, b1=0.9, b2=0.95, **decay, max_grad_norm=clip,
                           moment_dtype=moments)
  try:  # the placement and the optimizer checked against the model before any state exists
    build_engine(model_factory, tx, zero, mesh, open_store_=False)
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  processes = f" ({jax.process_count()} processes)" if jax.process_count() > 1 else ""
  say(f"zinfjax: {name} ({config.num_params / 1e6:.2f}M params, {config.num_layers} "
        f"layers x {config.hidden}) | ZeRO-{zero.stage} {zero.precision} on {dp} "
        f"{jax.devices()[0].platform} devices{processes} | data {args.data} ({len(tokens):,} "
        f"tokens, vocab {vocab})")
  host = " (host pipeline)" if zero.with_host_pipeline().host_store else ""
  say(f"placement: params+grads {zero.offload_param}, optimizer {zero.offload_optimizer}{host}, "
        f"activations {'pinned_host' if zero.offload_activations else 'device'}"
        + (f", nvme {zero.nvme_paths}" if zero.uses_nvme else "")
        + (f" | {zero.micro_batches} micro-batches of {args.batch_size // dp // zero.micro_batches}"
           " per device, layer by layer" if zero.micro_batches > 1 else "")
        + (f" | training LoRA adapters of rank {args.lora_rank} only" if args.lora_rank else "")
        + (" | Adam moments in bf16" if args.bf16_moments else ""))
  if auto is not None:
    say(auto.table())
  # made, checked writable and locked against other runs before any compute
  ckpt = Checkpointer(args.checkpoint_dir, keep=args.keep, lock=True) if args.checkpoint_dir else None
  t0 = time.perf_counter()
  state = None
  if ckpt is not None and ckpt.all_steps():
    if not args.resume:
      raise SystemExit(f"error: {ckpt.directory} already holds checkpoints (steps {ckpt.all_steps()}); "
                       "pass --resume (or --resume-step N) to continue, or choose another "
                       "--checkpoint-dir.")
    meta = ckpt.metadata(args.resume_step)
    same_model(meta.get("extra", {}).get("model"), config, ckpt.directory)  # before any read
    if "opt/count" not in meta["leaves"]:
      # saved by an older train_gpt.py with optax's AdamW chain (optimizer on the device)
      if zero.optimizer_split != (("device", None),):
        raise SystemExit(f"error: {ckpt.directory} holds optax AdamW states (an older train_gpt.py"
                         " with the optimizer on the device); resume it with --offload-optimizer "
                         "device, then save again to move it to other tiers.")
      tx = optax.adamw(schedule, b1=0.9, b2=0.95, **decay)
      tx = optax.chain(optax.clip_by_global_norm(clip), tx) if clip else tx
    restoring = init_line(sys.stdout, "restore", unit="bytes") if main_process else None
    if args.resume_step is not None:
      state, extra = ckpt.restore(model_factory, tx, zero, mesh, step=args.resume_step,
                                  progress=restoring)
    else:
      state, extra, skipped = ckpt.restore_newest(model_factory, tx, zero, mesh, restoring)
      for step, why in skipped:
        say(f"skipped checkpoint step {step}: it does not restore ({why})")
    same_model(extra.get("model"), config, ckpt.directory)
    say(f"resumed from step {int(state.step)} of {ckpt.directory} in {time.perf_counter() - t0:.1f} s")
  elif args.resume_step is not None:
    raise SystemExit(f"error: --resume-step {args.resume_step}: {ckpt.directory} holds no checkpoint.")
  elif args.resume:
    say(f"no checkpoint in {ckpt.directory} yet: starting from scratch")
  if state is None:
    try:
      state = zinfjax.init(model_factory, tx, zero, mesh, args.seed, params=weights,
                           init_missing=nnx.LoRAParam if args.lora_rank else None,
                           progress=init_line(sys.stdout, "loading" if weights else "init")
                           if main_process else None)
    except ValueError as e:  # weights that do not fit the model: named, before any step
      raise SystemExit(f"error: {e}") from None
    say(f"{'loaded' if weights else 'init'} {time.perf_counter() - t0:.1f} s | peak RSS {peak_rss() / 2**30:.2f} GiB", flush=True)
  start = int(state.step)
  if ckpt is not None:
    try:
      check_no_resave(ckpt.all_steps(), start, args)
    except SystemExit:
      state.close()
      raise
  plan, run = state.engine.plan, state.engine.config  # the run's tiers (auto, host pipeline)
  # the swap stores' shards as they lie there: aligned, with the all-or-nothing copies
  planned = need(plan, run)
  held = sum(plan.nvme_disk_bytes(run.nvme_atomic_steps, ranks=1, tier=t)["copies"]
             for t in plan.store_tiers)
  copies = (f" (of which {human_bytes(held)} are the copies that make each step all or nothing)"
            if held else "")
  say("model states per device (plan): " + ", ".join(f"{k} {human_bytes(v)}" for k, v in planned.items())
      + copies)
  step_fn = zinfjax.make_train_step(state, lm_loss)
  data = TokenDataset(tokens, seq_len, args.batch_size, seed=args.seed, step=start)
  progress = Progress(args.steps, metrics_jsonl=args.metrics_jsonl if main_process else None,
                      log_every=args.log_every, resumed_at=start,
                      **model_flops(args, config, seq_len, mesh),
                      stream=sys.stdout if main_process else open(os.devnull, "w"))
  tokens_per_step = args.batch_size * seq_len
  first_loss = last_loss = None
  skipped_in_a_row = 0
  step = start
  stop = interrupt_at_step_end()
  try:
    for step in range(start + 1, args.steps + 1):
      if stop:
        raise KeyboardInterrupt
      batch = data.at(0) if args.same_batch else next(data)
      t0 = time.perf_counter()
      state, metrics = step_fn(state, batch)
      loss = float(metrics["loss"])  # blocks until the step is done
      dt = time.perf_counter() - t0
      norm = float(metrics["grad_norm"])
      skipped = int(metrics.get("skipped", 0))  # non-finite grads: the step changed nothing
      skipped_in_a_row = skipped_in_a_row + 1 if skipped else 0
      if skipped_in_a_row >= MAX_SKIPPED or not (skipped or math.isfinite(loss) and math.isfinite(norm)):
        saved = f"; the last checkpoint is step {ckpt.latest_step()}" if ckpt and ckpt.latest_step() else ""
        times = f" ({skipped_in_a_row} steps in a row skipped)" if skipped else ""
        raise SystemExit(f"error: step {step}: the loss is {loss} and the grad norm {norm}{times}: "
                         f"training diverged (try a lower --lr than {args.lr}){saved}.")
      if skipped:
        say(f"step {step}: the gradients are not finite (norm {norm}); the step was skipped, every "
            "state is as it was")
      if ckpt is not None:
        ckpt.check()  # a save that failed in the background is reported now, not at the next one
      if not skipped:
        first_loss = loss if first_loss is None else first_loss
        last_loss = loss
      tiers = tier_bytes(state)
      if state.engine.store is not None:  # on the drive, and in RAM (host_optimizer="pipeline")
        for medium, used in used_by_medium(state.engine.store).items():
          tiers[str(medium)] = tiers.get(str(medium), 0) + used // len(jax.local_devices())
      breakdown = {k: float(v) for k, v in metrics.items()
                   if k.endswith("_s") or "bytes" in k or k in ("lr", "nvme_redone", "nvme_clip_predicted", "skipped")}
      if held_out is not None and (step % args.eval_every == 0 or step == args.steps):
        breakdown["eval_loss"] = float(zinfjax.eval_step(state, held_out, lm_loss)["loss"])
      progress.update(step, {"loss": loss, "grad_norm": norm,
                             "step_time_s": dt, "tokens_per_s": tokens_per_step / dt,
                             "tiers": tiers, "peak_rss": peak_rss(), "peak_hbm": peak_hbm(),
                             "least_ram_available": watch.take(), **breakdown})
      if args.export and step == args.steps:  # the last checkpoint and the export: every update
        state = zinfjax.flush_updates(state)   # (none held back by --delay-update)
      due = step == args.steps or args.save_every and step % args.save_every == 0
      if ckpt is not None and due:
        ckpt.save(state, extra={"args": vars(args), "model": dataclasses.asdict(config)})
  except KeyboardInterrupt:
    progress.close()
    if ckpt is not None:  # a save under way in the background is finished, not cut
      try:
        ckpt.close()
      except CheckpointError:
        pass  # the step's folder is removed; the committed ones are named below
    last = ckpt.latest_step() if ckpt is not None else None
    where = (f"the last complete checkpoint is step {last} in {ckpt.directory} (--resume goes on "
             "from it)" if last is not None else "no checkpoint was saved")
    print(f"\ninterrupted during step {step}: {where}.", file=sys.stderr)
    return 130
  progress.close()
  if ckpt is not None:
    ckpt.close()  # waits for the last save to commit
  if args.export and main_process:
    t0 = time.perf_counter()
    base = hf.read_config(args.init_from) if args.init_from else None
    # several processes: each holds its own shards; the checkpoint saved last holds them all
    one, held = jax.process_count() == 1, state.engine.pipeline and state.engine.pipeline.holding
    source = zinfjax.flush_updates(state) if one else CheckpointParams(args.checkpoint_dir)
    hf.save(args.export, config, source, args.export_dtype, base, copy_from=args.init_from)
    say(f"exported {args.export} (Hugging Face format) in {time.perf_counter() - t0:.1f} s")
    if held and not one:  # no step ran (the checkpoint was at --steps): as it was saved
      say("  with every update but the last step's, whose grads --delay-update holds for a next "
          "step (a checkpoint keeps them; --resume applies them)")
  if args.export and jax.process_count() > 1:  # the others wait for it, then shut down together
    import orbax.checkpoint as ocp
    ocp.multihost.sync_global_processes("zinfjax_export", timeout=24 * 3600)
  if first_loss is None:
    say(f"nothing to do: the run is at step {start} of {args.steps}")
  else:
    say(f"loss {first_loss:.4f} -> {last_loss:.4f} | peak RSS {peak_rss() / 2**30:.2f} GiB")
  return 0


if __name__ == "__main__":
  sys.exit(main())
