"""The README's Flax-loop example runs as written and trains."""

import os
import re
import subprocess
import sys

from helpers import REPO


def test_readme_example_trains(tmp_path):
  readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
  code = re.search(r"<!-- readme-example -->\s*```python\n(.*?)```", readme, re.S).group(1)
  assert len(code.strip().splitlines()) <= 15
  script = tmp_path / "example.py"
  script.write_text(code)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  out = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", out.stdout)]
  assert len(losses) == 4 and losses[-1] < losses[0] - 0.5, out.stdout
