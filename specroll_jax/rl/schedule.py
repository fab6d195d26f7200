"""When the periodic phases of a GRPO run happen: one rule for all of them."""


def due(every: int, step: int) -> bool:
  """Whether a phase run every `every` steps (0 = never) runs at GRPO step `step` (1-based)."""
  return every > 0 and step % every == 0
