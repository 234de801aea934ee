"""The placements the tests train under, as data, and `Placement`, what the `placement`
fixture (conftest.py) hands a test: one run per placement, each with its own swap folder.

A placement added to `PLACEMENTS` runs under every test that takes the fixture; a test that
needs a few names them with `@pytest.mark.parametrize("placement", [...], indirect=True)`.
"""

from __future__ import annotations

import dataclasses

import zinfjax

PLACEMENTS: dict[str, dict] = {
    "device": {},
    "stage1": dict(stage=1),
    "pinned": dict(offload_param="pinned_host", offload_optimizer="pinned_host"),
    "pipeline": dict(offload_param="pinned_host", offload_optimizer="pinned_host",
                     host_optimizer="pipeline"),
    "nvme": dict(offload_param="nvme", offload_optimizer="nvme"),
    "split": dict(offload_param="pinned_host:1,nvme:1,device", offload_optimizer="device:1,nvme"),
}
ZERO3 = [name for name, kw in PLACEMENTS.items() if kw.get("stage", 3) == 3]  # the default set


@dataclasses.dataclass(frozen=True)
class Placement:
  """One named placement; `zero()` is its ZeroConfig (fp32 unless told), its swap store (if it
  has one) under `folder`."""

  name: str
  folder: str

  def zero(self, **extra) -> zinfjax.ZeroConfig:
    kw = {"precision": "fp32", **PLACEMENTS[self.name], **extra}
    if "nvme" in str(kw):
      kw.setdefault("nvme_path", self.folder)
    return zinfjax.ZeroConfig(**kw)

  @property
  def states_on_device(self) -> bool:
    """Whether every optimizer state is an array on the device (so any optax optimizer runs);
    elsewhere the engine runs zinfjax's AdamW itself."""
    return "offload_optimizer" not in PLACEMENTS[self.name]

  def __str__(self) -> str:
    return self.name


def placed(name: str, tmp_path) -> Placement:
  """Placement `name`, its swap store (if any) under the test's `tmp_path`."""
  return Placement(name, str(tmp_path / "swap"))
