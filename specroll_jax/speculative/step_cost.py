"""What a tree step costs at each batch bucket, in plain steps: the speculation gate's price.

Measured on the engine's own compiled steps and on a rollout's own first state, not derived
from the capacity profile's forward latencies. Proposing and walking cost a third to a half
of a decode step on W3 (notes/history.md, the step profile), and a forward-only price would
leave that out.
"""
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
from absl import logging

from specroll_jax.rollout.driver import Driver, take_rows
from specroll_jax.rollout.engine import loop_compiler_options


# Steps per timed call: a call's dispatch (~0.1-0.3 ms on the CPU) is a large share of a
# stories260K step (~1.5 ms at 16 rows) and, counted once per step, it pulled the measured
# ratio towards 1 (W2 at 8 rows: a tree step measured at 1.8 plain steps cost 2.2 in the loop).
STEPS_PER_CALL = 8
# Most tree tokens per bucket (rows x nodes) for which sizing also tries projecting every
# node before the walk. At 16 rows x 4 nodes on W3 one projection of all 64 nodes
# (3.6 GFLOP, ~12.6 MB of logits) measured no gain over the walk's per-depth projections
# (notes/history.md, the step profile); below that the trial decides.
ONE_PROJECTION_MAX_TOKENS = 32


def compiled_steps(step):
  """`step` repeated STEPS_PER_CALL times in one call, in a loop like the decode loop's. The
  state is donated, so the cache is updated in place, not copied once per call (a copy
  would add the same constant to both kinds of step)."""
  def repeated(params, state, seed_key):
    return jax.lax.fori_loop(0, STEPS_PER_CALL, lambda _, s: step(params, s, seed_key), state)
  return jax.jit(repeated, donate_argnums=1, compiler_options=loop_compiler_options(jax.default_backend()))


def _tree_widths_to_try(widest: int) -> tuple:
  """Candidate widths for a bucket whose capacity allows `widest` nodes: powers of two from
  2 up to it, and `widest` itself (the proposer may cap it below a power of two)."""
  widths = [w for w in (2 ** k for k in range(1, widest.bit_length())) if w < widest]
  return tuple(widths) + (widest,)


@dataclasses.dataclass(frozen=True)
class WidthTrial:
  """One width's measurement at one batch bucket."""
  batch: int
  width: int
  one_projection: bool    # every node projected before the walk (else one per depth)
  cost: float             # tree step time / plain step time (median of the pairs)
  tokens_per_step: float  # tokens emitted per running row per tree step (the measured tau)

  @property
  def gain(self) -> float:
    """Expected speedup of tree steps at this width over plain steps."""
    return self.tokens_per_step / self.cost


def _price(tree_step, plain_step, params, state, seed_key, batch: int, repeats: int) -> tuple:
  """(median tree/plain time ratio, tokens per row step of the tree steps) at `batch` rows.

  Calls of STEPS_PER_CALL tree steps and of as many plain steps alternate, each from the
  first `batch` rows of `state`, so a drift in background load hits both alike. Every pair
  starts from that state: rows that ran on would finish (an oracle accepts up to 16 tokens
  per step), and steps over finished rows walk nothing.
  """
  first_rows = jnp.arange(batch, dtype=jnp.int32)
  jax.block_until_ready(plain_step(params, tree_step(params, take_rows(state, first_rows),
                                                     seed_key), seed_key))
  ratios, tokens, row_steps = [], 0, 0
  for _ in range(repeats):
    rows = jax.block_until_ready(take_rows(state, first_rows))
    before = (int(jnp.sum(rows.seqs.num_generated)), int(jnp.sum(rows.seqs.steps)))
    start = time.perf_counter()
    after = jax.block_until_ready(tree_step(params, rows, seed_key))
    tree_seconds = time.perf_counter() - start
    tokens += int(jnp.sum(after.seqs.num_generated)) - before[0]
    row_steps += int(jnp.sum(after.seqs.steps)) - before[1]
    rows = jax.block_until_ready(take_rows(state, first_rows))
    start = time.perf_counter()
    jax.block_until_ready(plain_step(params, rows, seed_key))
    ratios.append(tree_seconds / (time.perf_counter() - start))
  return statistics.median(ratios), tokens / max(row_steps, 1)


def _priced_buckets(engine, state, buckets) -> list:
  full = state.seqs.done.shape[0]
  return [b for b in sorted(buckets) if b <= full and engine.tree_width(b) > 1]


def measure_step_costs(engine, params, state, seed_key, buckets, repeats: int = 5) -> tuple:
  """((batch, tree step time / plain step time), ...) ascending, for every bucket in `buckets`
  at or below the batch of `state` whose trees have more than one node per row.

  Each bucket's state is the first `batch` rows of `state`, typically the driver's first
  state; the cost is the median ratio over `repeats` alternating pairs of calls.
  """
  if repeats < 1:
    raise ValueError(f'repeats must be >= 1, got {repeats}')
  tree_step, plain_step = compiled_steps(engine.tree_step), compiled_steps(engine.plain_step)
  costs = []
  for batch in _priced_buckets(engine, state, buckets):
    cost, _ = _price(tree_step, plain_step, params, state, seed_key, batch, repeats)
    costs.append((batch, cost))
    logging.info('tree step at batch %d (width %d): %.2f plain steps', batch,
                 engine.tree_width(batch), cost)
  return tuple(costs)


def size_trees(engine, params, state, seed_key, buckets, repeats: int = 5) -> tuple:
  """(engine with sized tree widths and their costs, the WidthTrials measured).

  For every bucket that `measure_step_costs` would price, each candidate width (powers of
  two up to the capacity's width), walked with a projection per depth and, up to
  ONE_PROJECTION_MAX_TOKENS tree tokens, with one projection of every node, is priced and
  its tokens per row step measured on the same calls; the bucket gets the trial with the
  largest ratio of the two, the expected speedup of its tree steps. Where even that ratio
  is below 1, the gate runs plain steps there, as before. Tokens per step come from the rollout's own first steps, so sizing
  reflects this workload's drafts (an oracle's chains, a warm start's heads), not a prior.
  """
  if repeats < 1:
    raise ValueError(f'repeats must be >= 1, got {repeats}')
  plain_step = compiled_steps(engine.plain_step)  # the same program at every width
  tc = engine.tree_config
  trials, chosen = [], []
  for batch in _priced_buckets(engine, state, buckets):
    bucket_trials = []
    for width in _tree_widths_to_try(engine.tree_width(batch)):
      for one_projection in (False, True)[:1 + (batch * width <= ONE_PROJECTION_MAX_TOKENS)]:
        trial_config = dataclasses.replace(tc, sized_widths=((batch, width),),
                                           one_projection=(batch,) if one_projection else ())
        trial_engine = dataclasses.replace(engine, tree_config=trial_config)
        cost, tau = _price(compiled_steps(trial_engine.tree_step), plain_step, params, state,
                           seed_key, batch, repeats)
        bucket_trials.append(WidthTrial(batch, width, one_projection, cost, tau))
        logging.info('batch %d, width %d, %s: %.2f plain steps, %.2f tokens per step', batch,
                     width, 'one projection' if one_projection else 'per-depth projections',
                     cost, tau)
    trials += bucket_trials
    chosen.append(max(bucket_trials, key=lambda t: t.gain))
  sized = dataclasses.replace(
      engine, tree_config=dataclasses.replace(
          tc, sized_widths=tuple((t.batch, t.width) for t in chosen),
          one_projection=tuple(t.batch for t in chosen if t.one_projection)),
      tree_step_costs=tuple((t.batch, t.cost) for t in chosen))
  return sized, tuple(trials)


@dataclasses.dataclass(frozen=True)
class GatePrices:
  """What pricing measured for one engine: its gate's costs and, when sized, its widths. A
  run saves them so that a resumed run, or a smaller batch of a sweep, decides as it did."""
  tree_step_costs: tuple      # ((batch, plain steps), ...); empty: no gate, every step a tree
  sized_widths: tuple = ()    # ((batch, nodes), ...); empty: the capacity decides
  one_projection: tuple = ()  # batches whose walk projects every node at once

  @classmethod
  def of(cls, engine) -> 'GatePrices':
    return cls(engine.tree_step_costs, engine.tree_config.sized_widths,
               engine.tree_config.one_projection)

  def applied_to(self, engine):
    tree = dataclasses.replace(engine.tree_config, sized_widths=self.sized_widths,
                               one_projection=self.one_projection)
    return dataclasses.replace(engine, tree_step_costs=self.tree_step_costs, tree_config=tree)


def with_measured_step_costs(engine, rollout_config, params, prompts, num_samples: int,
                             repeats: int = 5, size_widths: bool = False):
  """`engine` with its gate priced on this workload: the tree-step costs measured on the
  first state a Driver(engine, rollout_config) would run for `prompts` x `num_samples`;
  with `size_widths`, each bucket's tree width chosen as `size_trees` does."""
  driver = Driver(engine, rollout_config)
  state = driver.first_state(params, prompts, num_samples)
  if size_widths:
    return size_trees(engine, params, state, jax.random.key(0), driver.buckets, repeats)[0]
  costs = measure_step_costs(engine, params, state, jax.random.key(0), driver.buckets, repeats)
  return dataclasses.replace(engine, tree_step_costs=costs)
