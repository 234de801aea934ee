"""`bench_gpu.py`'s results as ratios (each step row against the all-device row, and against the
bound its placement cannot beat) and as one Markdown table."""

from __future__ import annotations

# dense bf16 TFLOP/s of an H100 / H200 SXM (NVIDIA's datasheet): the second MFU denominator
SPEC_TFLOPS = 989.0
# the step row every other row of its tokens is compared with
DEVICE_ROW = "all on device (compute alone)"

# bytes of optimizer state per parameter the streamed update moves each way over the host link:
# fp32 master and both moments (the bench's AdamW keeps fp32 moments)
STREAMED_BYTES = 12


def ratios(rows: list[dict], host: dict | None = None, copies: dict | None = None,
           params: int | None = None) -> list[dict]:
  """Each row against the all-device row of its tokens, the NVMe rows against I/O alone, the
  host-pipeline rows against the host's step alone (`host_alone`), and the streamed update's
  rows against compute plus its states crossing the link alone, each way at once (at the rate of
  XLA's own copies inside jit, `memory_kind_copies`): it runs after backward."""
  for row in rows:
    base = [r for r in rows if r["tokens"] == row["tokens"] and r["placement"] == DEVICE_ROW
            and "step_s" in r]
    if "step_s" not in row or not base:
      continue
    compute = base[0]["step_s"]
    row["vs_compute"] = row["step_s"] / compute
    # the host's step alone, with the row's moments (bf16 ones timed where a row asks)
    if host and "host pipeline" in row["placement"] and "nvme" not in row["placement"]:
      alone = host.get("pipeline_bf16_s" if "bf16 moments" in row["placement"] else "pipeline_s")
      if alone is not None:
        row["host_alone_s"] = alone
    alone = row.get("io_alone_s", row.get("host_alone_s"))
    if alone is not None:
      row["vs_bound"] = row["step_s"] / max(compute, alone)
    if copies and params and "streamed through the device" in row["placement"]:
      gbs = min(copies["jit_h2d"], copies["jit_d2h"])
      row["link_alone_s"] = STREAMED_BYTES * params / (gbs * 1e9)
      row["vs_bound"] = row["step_s"] / (compute + row["link_alone_s"])
  return rows


def table(r: dict) -> str:
  """The run's table in Markdown; parts that failed or did not run are left out."""
  c, k, s, d, h, n = (r.get(name, {}) for name in ("ceiling", "memory_kinds", "swap", "disk",
                                                    "host", "numpy"))
  ratio = lambda x, key: f"{x / c[key]:.2f}x" if key in c else "n/a"
  cell = lambda x, key: f"{x:.1f} ({ratio(x, key)})"
  lines = [f"\n{r['device']}: host <-> device GB/s (ratio to the pinned cudaMemcpyAsync ceiling)",
           "| path | host->device | device->host |", "|---|---|---|"]
  if "h2d" in c:
    lines.append(f"| {c['tool']} (ceiling) | {c['h2d']:.1f} | {c['d2h']:.1f} |")
  if k:
    lines += [f"| jax.device_put memory kinds, eager | {cell(k['eager_h2d'], 'h2d')} "
              f"| {cell(k['eager_d2h'], 'd2h')} |",
              f"| memory kinds inside jit (+1 elementwise pass) | {cell(k['jit_h2d'], 'h2d')} "
              f"| {cell(k['jit_d2h'], 'd2h')} |"]
  if s:
    lines.append(f"| zinfjax swap handlers, store in /dev/shm | {cell(s['store_then_h2d'], 'h2d')} "
                 f"| {cell(s['d2h_then_store'], 'd2h')} |")
  if n:
    lines += [f"| numpy, one array at a time (`jax.device_put` / `np.asarray`) "
              f"| {cell(n['h2d_device_put'], 'h2d')} | {cell(n['d2h_asarray'], 'd2h')} |",
              f"| numpy, four copies started at once (`copy_to_host_async`) | "
              f"| {cell(n['d2h_started'], 'd2h')} |",
              f"| numpy through a pinned-host array | {cell(n['h2d_via_pinned'], 'h2d')} "
              f"| {cell(n['d2h_via_pinned'], 'd2h')} |"]
    if "duplex" in n:  # both ways at once, against the two ceilings added
      both = f"{c['h2d'] + c['d2h']:.1f}" if "h2d" in c else "n/a"
      lines.append(f"| numpy, both ways at once (GB/s of the two; ceilings added: {both}) "
                   f"| {n['duplex']:.1f} | |")
  if "matmul_tflops" in r:
    lines.append(f"\nbf16 matmul {r['matmul_n']}^3: {r['matmul_tflops']:.0f} TFLOP/s")
  if d:
    lines.append(f"\ndisk: {d['ceiling_tool']} write {d['ceiling_write']:.2f} / read "
                 f"{d['ceiling_read']:.2f} GB/s, zinfjax store ({d['store_backend']}) write "
                 f"{d['store_write']:.2f} / read {d['store_read']:.2f} GB/s")
  if h:
    lines.append(f"\nhost ({h['threads']} threads): copy {h['copy_gbs']:.1f} GB/s (read + write); "
                 f"over the model's {h['params'] / 1e6:.0f}M params the C++ AdamW alone "
                 f"{h['adam_s']:.3f} s, "
                 f"a host-pipeline step alone (RAM store, in place) {h['pipeline_s']:.3f} s"
                 + (f" ({h['pipeline_bf16_s']:.3f} s with bf16 moments)"
                    if "pipeline_bf16_s" in h else "")
                 + ("; one AdamW call over a block's largest tensor, ms by threads: " + ", ".join(
                     f"{t}: {ms:.2f}" for t, ms in h["call_ms_by_threads"].items())
                    if h.get("call_ms_by_threads") else ""))
  if r.get("steps"):
    if r.get("model"):
      lines.append(f"\nsteps of {r['model']}")
    lines += ["\n| tokens/step | placement | step s | tokens/s | TFLOP/s | MFU of measured matmul "
              f"| MFU of {SPEC_TFLOPS:.0f} (spec) | vs all on device "
              "| vs max(compute, I/O or host alone), or compute + link alone "
              "| peak HBM GiB | peak RSS GiB | loss |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for row in r.get("steps", []):
    if "error" in row:
      lines.append(f"| {row['tokens']} | {row['placement']} | failed: {row['error']} |")
      continue
    what, alone = next(((w, row[k]) for w, k in (("I/O alone", "io_alone_s"),
                                                  ("host alone", "host_alone_s"),
                                                  ("after compute, link alone", "link_alone_s"))
                        if k in row), ("", 0.0))
    bound = f"{row['vs_bound']:.2f}x ({what} {alone:.2f} s)" if "vs_bound" in row else ""
    vs = f"{row['vs_compute']:.2f}x" if "vs_compute" in row else ""
    spec = f"{row['mfu_spec']:.1%}" if "mfu_spec" in row else ""
    mfu = f"{row['mfu']:.1%}" if row.get("mfu") is not None else ""
    gib = lambda key: f"{row[key] / 2**30:.1f}" if row.get(key) is not None else ""
    lines.append(f"| {row['tokens']} | {row['placement']} | {row['step_s']:.3f} "
                 f"| {row['tokens_per_s']:.0f} "
                 f"| {row['tflops']:.1f} | {mfu} | {spec} | {vs} | {bound} | {gib('peak_hbm')} "
                 f"| {gib('peak_rss')} | {row['loss']:.4f} |")
  for name, tb in r.get("errors", {}).items():
    lines.append(f"\n{name} failed: {tb.strip().splitlines()[-1]}")
  return "\n".join(lines)


def phase_line(row: dict) -> str:
  parts = [f"{k[:-2]} {v:.3f} s" for k, v in row.get("phases", {}).items()]
  if "buffers_made" in row:
    b = row["buffers_made"]
    parts.append(f"lent buffers made {b['count']} ({b['bytes'] / 2**30:.2f} GiB) "
                 f"in {b['steps']} steps")
  if row.get("mapping_pinned_bytes"):
    parts.append(f"RAM store page-locked {row['mapping_pinned_bytes'] / 2**30:.2f} GiB")
  if "kernel_pass" in row:
    k = row["kernel_pass"]
    parts.append(f"kernel alone on the store {k['views_s']:.3f} s (its largest block tensors, "
                 f"{k['sample_params'] / 1e6:.0f}M params: {k['sample_views_s']:.3f} s there, "
                 f"{k['sample_copies_s']:.3f} s on host copies)")
  return f" ({', '.join(parts)})" if parts else ""
