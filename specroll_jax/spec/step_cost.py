"""What a tree step costs at each batch bucket, in plain steps: the speculation gate's price.

Measured on the engine's own compiled steps and on a rollout's own first state, not derived
from the capacity profile's forward latencies. Proposing and walking cost a third to a half
of a decode step on W3 (WORKSPACE_NOTES, the step profile), and a forward-only price would
leave that out.
"""
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
from absl import logging

from specroll_jax.rollout.driver import Driver, take_rows
from specroll_jax.rollout.engine import LOOP_COMPILER_OPTIONS


# Steps per timed call: a call's dispatch (~0.1-0.3 ms on the CPU) is a large share of a
# stories260K step (~1.5 ms at 16 rows) and, counted once per step, it pulled the measured
# ratio towards 1 (W2 at 8 rows: a tree step measured at 1.8 plain steps cost 2.2 in the loop).
STEPS_PER_CALL = 8


def _compiled(step):
  """`step` repeated STEPS_PER_CALL times in one call, in a loop like the decode loop's. The
  state is donated, so the cache is updated in place, not copied once per call (a copy
  would add the same constant to both kinds of step)."""
  def repeated(params, state, seed_key):
    return jax.lax.fori_loop(0, STEPS_PER_CALL, lambda _, s: step(params, s, seed_key), state)
  return jax.jit(repeated, donate_argnums=1, compiler_options=LOOP_COMPILER_OPTIONS)


def measure_step_costs(engine, params, state, seed_key, buckets, repeats: int = 5) -> tuple:
  """((batch, tree step time / plain step time), ...) ascending, for every bucket in `buckets`
  at or below the batch of `state` whose trees have more than one node per row.

  Each bucket's state is the first `batch` rows of `state`, typically the driver's first
  state. Calls of STEPS_PER_CALL tree steps and of as many plain steps alternate, each from
  that state, so a drift in background load hits both alike. The cost is the median ratio
  over `repeats` pairs of calls.
  """
  if repeats < 1:
    raise ValueError(f'repeats must be >= 1, got {repeats}')
  full = state.seqs.done.shape[0]
  tree_step, plain_step = _compiled(engine.tree_step), _compiled(engine.plain_step)
  costs = []
  for batch in sorted(b for b in buckets if b <= full):
    if engine.tree_width(batch) == 1:
      continue
    first_rows = jnp.arange(batch, dtype=jnp.int32)
    jax.block_until_ready(plain_step(params, tree_step(params, take_rows(state, first_rows),
                                                       seed_key), seed_key))
    ratios = []
    for _ in range(repeats):
      # Every pair starts from the first state: rows that ran on would finish (an oracle
      # accepts up to 16 tokens per step), and steps over finished rows walk nothing.
      rows = jax.block_until_ready(take_rows(state, first_rows))
      start = time.perf_counter()
      jax.block_until_ready(tree_step(params, rows, seed_key))
      tree_seconds = time.perf_counter() - start
      rows = jax.block_until_ready(take_rows(state, first_rows))
      start = time.perf_counter()
      jax.block_until_ready(plain_step(params, rows, seed_key))
      ratios.append(tree_seconds / (time.perf_counter() - start))
    costs.append((batch, statistics.median(ratios)))
    logging.info('tree step at batch %d (width %d): %.2f plain steps', batch,
                 engine.tree_width(batch), costs[-1][1])
  return tuple(costs)


def with_measured_step_costs(engine, rollout_config, params, prompts, num_samples: int,
                             repeats: int = 5):
  """`engine` with its gate priced on this workload: the tree-step costs measured on the
  first state a Driver(engine, rollout_config) would run for `prompts` x `num_samples`."""
  driver = Driver(engine, rollout_config)
  state = driver.first_state(params, prompts, num_samples)
  costs = measure_step_costs(engine, params, state, jax.random.key(0), driver.buckets, repeats)
  return dataclasses.replace(engine, tree_step_costs=costs)
