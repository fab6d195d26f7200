"""What a run holds in memory, sampled once per GRPO step (the soak's evidence)."""
import os

import jax


def _resident_mib() -> float | None:
  """The current resident set (Linux's /proc; None where the platform has no such file)."""
  try:
    with open('/proc/self/statm') as f:
      return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20
  except FileNotFoundError:
    return None


def process_memory() -> dict:
  """Resident set size of this process and JAX's live device buffers, in MiB."""
  arrays = jax.live_arrays()
  return {'rss_mib': _resident_mib(),
          'live_arrays': len(arrays),
          'live_array_mib': sum(a.nbytes for a in arrays) / 2**20}
