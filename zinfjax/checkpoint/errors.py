"""What a failed restore raises (each names the array or step and why)."""


class CheckpointError(ValueError):
  """A checkpoint that cannot be restored here (missing, damaged, or from another run)."""


class CheckpointMismatch(CheckpointError):
  """A sound checkpoint of another model or optimizer: no other step of it restores here."""
