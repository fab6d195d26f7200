"""Timing the phases of one GRPO step."""
import contextlib
import time

from absl import logging

from specroll_jax.rollout.compilation import compilations_so_far


class PhaseTimer:
  """Seconds per phase of one GRPO step (a phase entered twice adds up), and the XLA
  compilations since the step began.

  Each phase logs `step N: name` as it starts: that line is where a log reader (and the
  kill-and-resume test) sees the run is. A phase's work must be finished on device when its
  block ends (`jax.block_until_ready`), or its time lands in the next phase.
  """

  def __init__(self, step: int):
    self.step = step
    self.seconds: dict[str, float] = {}
    self._compiled_before = compilations_so_far()

  def compilations(self) -> int:
    return compilations_so_far() - self._compiled_before

  @contextlib.contextmanager
  def __call__(self, name: str):
    logging.info('step %d: %s', self.step, name)
    start = time.perf_counter()
    try:
      yield
    finally:
      self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
