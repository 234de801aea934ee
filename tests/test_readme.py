"""The README's examples run as written: the Flax loop trains, the fine-tuning example exports."""

import os
import re
import subprocess
import sys

from helpers import REPO


def _run_example(marker: str, tmp_path, replace: dict[str, str] | None = None) -> str:
  """Run the README's python block after `<!-- marker -->` on 8 host devices; its stdout."""
  readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
  code = re.search(rf"<!-- {marker} -->\s*```python\n(.*?)```", readme, re.S).group(1)
  assert len(code.strip().splitlines()) <= 16
  for old, new in (replace or {}).items():
    code = code.replace(old, new)
  script = tmp_path / f"{marker}.py"
  script.write_text(code)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  out = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def test_readme_example_trains(tmp_path):
  stdout = _run_example("readme-example", tmp_path)
  losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", stdout)]
  assert len(losses) == 4 and losses[-1] < losses[0] - 0.5, stdout


def test_readme_finetune_example_runs(tmp_path):
  """The fine-tuning example loads a Hugging Face checkpoint, lowers its eval loss, exports."""
  stdout = _run_example("readme-finetune", tmp_path, {
      "/tmp/zinfjax-finetuned": str(tmp_path / "out"),
      "/tmp/zinfjax-finetune": str(tmp_path / "swap")})
  before = float(re.search(r"eval loss before ([0-9.]+)", stdout).group(1))
  after = float(re.search(r"eval loss after ([0-9.]+)", stdout).group(1))
  assert after < before - 0.05, stdout
  assert (tmp_path / "out" / "model.safetensors").exists()
