"""Progress of long work: per step, a bar on a terminal, a log line elsewhere, and a JSONL
metrics file; for an init or a load, the params placed so far (`Tally`, `init_line`)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import IO, Any, Callable

# `zinfjax.init(progress=...)`: called with (params placed, params in all, seconds so far)
InitReport = Callable[[int, int, float], None]
REPORT_EVERY_S = 2.0  # an init's reports: at most this often


def peak_rss() -> int:
  """This process's peak resident memory in bytes (VmHWM; 0 where /proc is missing). Not
  `ru_maxrss`: Linux carries that over an exec, so a child started by a large process would
  report the parent's peak."""
  return _status_bytes("VmHWM:")


def reset_peak_rss() -> bool:
  """Start `peak_rss` afresh from what is resident now (Linux's /proc/self/clear_refs), so it
  tells the peak of what follows alone; False where the kernel does not allow it."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def rss() -> int:
  """This process's resident memory in bytes now (VmRSS; 0 where /proc is missing)."""
  return _status_bytes("VmRSS:")


def _status_bytes(field: str) -> int:
  try:
    with open("/proc/self/status") as f:
      return next((int(l.split()[1]) << 10 for l in f if l.startswith(field)), 0)
  except OSError:
    return 0


def host_memory() -> tuple[int, int] | None:
  """(bytes available, bytes in all) of the machine's RAM: /proc/meminfo's MemAvailable, what
  can be had without swapping, and MemTotal; None where /proc is missing."""
  try:
    with open("/proc/meminfo") as f:
      info = {l.split(":")[0]: int(l.split()[1]) << 10 for l in f
              if l.startswith(("MemAvailable:", "MemTotal:"))}
    return info["MemAvailable"], info["MemTotal"]
  except (OSError, KeyError, ValueError, IndexError):
    return None


class HostMemoryWatch:
  """The machine's available RAM, sampled on a thread: the least seen since the last `take()`
  (a step's record), and a line to `say` when it falls under `low` of the RAM (at most every
  `quiet_s`), so a run the kernel kills for memory leaves word of how it got there."""

  def __init__(self, say: Callable[[str], None], low: float = 0.05, every_s: float = 0.1,
               quiet_s: float = 10.0,
               read: Callable[[], tuple[int, int] | None] = host_memory):
    self.say, self.low, self.every_s, self.quiet_s = say, low, every_s, quiet_s
    self.read = read  # (available, total) bytes, or None: host_memory, or a test's own
    self.least: int | None = None
    self.told = -float("inf")
    self.stop = threading.Event()
    self.thread = threading.Thread(target=self._run, name="zinfjax-memwatch", daemon=True)
    if read() is not None:
      self.thread.start()

  def _run(self) -> None:
    while not self.stop.wait(self.every_s):
      seen = self.read()
      if seen is None:
        return
      available, total = seen
      self.least = available if self.least is None else min(self.least, available)
      now = time.perf_counter()
      if available < self.low * total and now - self.told >= self.quiet_s:
        self.told = now
        self.say(f"host memory low: {human_bytes(available)} available of "
                 f"{human_bytes(total)}, this process {human_bytes(rss())} resident")

  def take(self) -> int | None:
    """The least available RAM seen since the last call; where no sample came since (a step
    shorter than `every_s`), what is available now (None where /proc is missing)."""
    least, self.least = self.least, None
    if least is None:
      seen = self.read()
      least = None if seen is None else seen[0]
    return least

  def close(self) -> None:
    self.stop.set()
    if self.thread.is_alive():
      self.thread.join()

  def __enter__(self) -> "HostMemoryWatch":
    return self

  def __exit__(self, *exc) -> None:
    self.close()  # on every way out: a watch left running would outlive its run


def human_bytes(n: float, digits: int = 1) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
    n /= 1024
  return f"{n:.{digits}f} TiB"


def parse_bytes(text: str) -> int:
  """'40GiB', '512MiB', '2GB', '2e9' -> bytes (ValueError for anything else)."""
  units = {"TiB": 2**40, "GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "TB": 10**12, "GB": 10**9,
           "MB": 10**6, "KB": 10**3, "B": 1}
  text = text.strip()
  for unit, scale in units.items():
    if text.endswith(unit):
      return int(float(text[:-len(unit)]) * scale)
  return int(float(text))


def parse_budgets(items: list[str]) -> dict[str, int]:
  """["device=40GiB", "nvme=1TB"] -> {"device": 42949672960, "nvme": 10**12}."""
  out = {}
  for item in items:
    tier, sep, size = item.partition("=")
    try:
      if not sep:
        raise ValueError
      out[tier.strip()] = parse_bytes(size)
    except ValueError:
      raise ValueError(f"--budget {item!r}: give TIER=SIZE, e.g. device=40GiB or nvme=1TB.") from None
  return out


def _stream(path: str) -> bool:
  """A path of /dev or /proc: a terminal, a pipe, or a file opened by the shell (/dev/stdout)."""
  return os.path.abspath(path).startswith(("/dev/", "/proc/"))


def metrics_problem(path: str) -> str | None:
  """Why `path` cannot be a run's metrics file, or None: an existing file that is not empty
  and holds no JSON record in its first lines is someone's data, which a run would empty.
  A stream (/dev/stdout) is never read."""
  if not os.path.isfile(path) or _stream(path):
    return None
  try:
    with open(path, "rb") as f:
      head = f.read(1 << 16)
  except OSError as e:
    return f"cannot read it ({e.strerror or e})"
  if not head.strip():
    return None
  for line in head.splitlines()[:8]:
    try:
      if isinstance(json.loads(line), dict):
        return None
    except ValueError:
      continue
  return ("it holds something other than metrics (no JSON record in its first lines), which "
          "the run would overwrite; give a new path, or remove the file if it is an old one")


def open_metrics(path: str, resumed_at: int) -> IO[str]:
  """The JSONL metrics file, open for appending this run's records. A fresh run (`resumed_at`
  0) starts it empty; a resumed one keeps the records of steps up to `resumed_at` (before the
  checkpoint it resumes from) and drops the later ones, which it writes again, and lines a
  kill cut short. A file that holds other data is refused (`metrics_problem`), not emptied."""
  problem = metrics_problem(path)
  if problem:
    raise ValueError(f"metrics file {path}: {problem}.")
  if _stream(path):  # /dev/stdout and the like: written on, never emptied (a log behind it)
    return open(path, "a")
  if resumed_at <= 0 or not os.path.isfile(path):
    return open(path, "w")
  kept = []
  with open(path) as f:
    for line in f:
      try:
        record = json.loads(line)
      except ValueError:
        continue
      if isinstance(record, dict) and record.get("step", resumed_at + 1) <= resumed_at:
        kept.append(json.dumps(record) + "\n")
  target = os.path.realpath(path)  # a link stays a link
  fresh = f"{target}.tmp{os.getpid()}"
  try:  # the old records stay whole until the kept ones are written
    with open(fresh, "w") as f:
      f.writelines(kept)
    os.replace(fresh, target)
  except OSError:  # a folder this run may not add files to: rewrite the file in place
    if os.path.exists(fresh):
      os.remove(fresh)
    with open(target, "w") as f:
      f.writelines(kept)
  return open(target, "a")


class Progress:
  """Shows loss, tokens/s, step time and bytes per tier; writes one JSON object per step."""

  def __init__(self, total: int, *, metrics_jsonl: str | None = None, log_every: int = 1,
               stream: IO[str] = sys.stdout, width: int = 24, resumed_at: int = 0,
               flops_per_device: float | None = None, peak_tflops: float | None = None):
    """`resumed_at`: the step a resumed run goes on from; the metrics file keeps its records
    up to there (a fresh run, 0, starts it empty). `flops_per_device`: the model FLOPs of a step
    on each device (the standard count, `GPTConfig.train_flops`), shown as TFLOP/s per device,
    and as MFU, their share of `peak_tflops` (a device's dense bf16 peak), when given."""
    self.total, self.log_every, self.stream, self.width = total, max(1, log_every), stream, width
    self.flops, self.peak = flops_per_device, peak_tflops
    self.tty = stream.isatty()
    self.jsonl = open_metrics(metrics_jsonl, resumed_at) if metrics_jsonl else None
    self.start = time.perf_counter()

  def update(self, step: int, record: dict[str, Any]) -> None:
    """`record` holds at least loss, step_time_s, tokens_per_s; `tiers` maps tier -> bytes."""
    if self.flops:
      record = {**record, "tflops_per_device": self.flops / record["step_time_s"] / 1e12}
      if self.peak:
        record["mfu"] = record["tflops_per_device"] / self.peak
    if self.jsonl:
      self.jsonl.write(json.dumps({"step": step, **record}) + "\n")
      self.jsonl.flush()
    if not (self.tty or step % self.log_every == 0 or step == self.total):
      return
    done = int(self.width * step / max(self.total, 1))
    bar = "#" * done + "." * (self.width - done)
    tiers = " ".join(f"{k} {human_bytes(v)}" for k, v in record.get("tiers", {}).items())
    line = f"step {step:>5}/{self.total} [{bar}] loss {record['loss']:.4f}"
    if "eval_loss" in record:
      line += f" (eval {record['eval_loss']:.4f})"
    if "lr" in record:
      line += f", lr {record['lr']:.2e}"
    line += (f" | "
            f"{record['tokens_per_s']:,.0f} tok/s | {1e3 * record['step_time_s']:.1f} ms/step | "
            f"per device: {tiers}")
    if "tflops_per_device" in record:
      line += f" | {record['tflops_per_device']:.3g} TFLOP/s per device"
      if "mfu" in record:
        line += f", MFU {record['mfu']:.1%} (of {self.peak:.4g})"
    if "optimizer_s" in record:  # offloaded optimizer: where the step's time went
      line += (f" | fwd/bwd {record['fwd_bwd_s']:.2f} s, optimizer {record['optimizer_s']:.2f} s "
               f"(Adam {record['adam_s']:.2f} s")
      if record["nvme_bytes_read"] or record["nvme_bytes_written"]:  # none in RAM's store
        line += (f", NVMe read wait {record['nvme_read_wait_s']:.2f} s, "
                 f"write wait {record['nvme_write_wait_s']:.2f} s, "
                 f"{human_bytes(record['nvme_bytes_read'])} read, "
                 f"{human_bytes(record['nvme_bytes_written'])} written")
      line += ")"
    if "peak_rss" in record:
      line += f" | peak RSS {human_bytes(record['peak_rss'])}"
    if record.get("least_ram_available") is not None:
      line += f", RAM free at least {human_bytes(record['least_ram_available'])}"
    self.stream.write(("\r" + line) if self.tty else (line + "\n"))
    self.stream.flush()

  def close(self) -> None:
    if self.tty:
      self.stream.write("\n")
    if self.jsonl:
      self.jsonl.close()
    self.stream.write(f"done in {time.perf_counter() - self.start:.1f} s\n")
    self.stream.flush()


class Tally:
  """Counts the params an init or a load has placed, and reports them at most every
  `REPORT_EVERY_S` seconds (the first after that long, so a quick init says nothing) and once
  when done."""

  def __init__(self, total: int, report: InitReport | None):
    self.total, self.report = total, report
    self.every_s = REPORT_EVERY_S
    self.done, self.start = 0, time.perf_counter()
    self.last = self.start

  def add(self, params: int) -> None:
    self.done += params
    now = time.perf_counter()
    if self.report is not None and now - self.last >= self.every_s:
      self.last = now
      self.report(self.done, self.total, now - self.start)

  def close(self) -> None:
    """The final report, where any came before it."""
    if self.report is not None and self.last > self.start:
      self.report(self.done, self.total, time.perf_counter() - self.start)


def human_count(n: float) -> str:
  """3.2B, 125.0M, 4.1K: a number of params."""
  for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.1f}{unit}"
  return f"{n:.0f}"


def init_line(stream: IO[str] = sys.stdout, what: str = "init", unit: str = "params") -> InitReport:
  """An `InitReport` that writes `init 45% | 7.8B of 17.3B params | 12 s, about 15 s left`;
  with `unit="bytes"` (a restore's counts) `restore 45% | 12.1 GiB of 26.9 GiB | ...`."""
  amount = human_bytes if unit == "bytes" else human_count
  suffix = "" if unit == "bytes" else f" {unit}"

  def report(done: int, total: int, seconds: float) -> None:
    share = done / max(total, 1)
    left = f", about {seconds * (1 - share) / share:.0f} s left" if 0 < share < 1 else ""
    stream.write(f"{what} {100 * share:3.0f}% | {amount(done)} of {amount(total)}{suffix} "
                 f"| {seconds:.0f} s{left}\n")
    stream.flush()

  return report
