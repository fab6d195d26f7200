"""One GRPO rollout's time by batch bucket, per rollout variant, from the driver's segments:
what experiments/profile/buckets.py measures and reports (kept apart from its flags, so that
tests and other scripts import it)."""
import statistics

import numpy as np

from experiments.lib.results import Figure, Result, Table, command_line
from experiments.lib.variant_runs import BASELINE
from specroll_jax.rl.rollouts import step_seed

QUANTITIES = ('seconds', 'tokens', 'row_steps')


def timed_rollouts(runs: dict, repeats: int) -> tuple[dict, dict]:
  """Each variant's rollout of its first step's prompts, with that step's seed: one that
  compiles, then `repeats` in alternation; (per variant: each timed rollout's driver
  segments, the engine's summary of the last one)."""
  inputs = {variant: (run.learner.rollout_params(state), state.heads,
                      run.step_tasks(int(state.data_position))[1],
                      step_seed(run.config, int(state.step)))
            for variant, (run, state) in runs.items()}
  segments, summaries = {v: [] for v in runs}, {}
  for repeat in range(repeats + 1):
    for variant, (run, _) in runs.items():
      found = []
      responses = run.rollouts.generate(*inputs[variant], found)
      if repeat:
        segments[variant].append(found)
      summaries[variant] = run.rollouts.engine.summarize(responses)
  return segments, summaries


def by_bucket(rollouts: list[list]) -> dict:
  """batch bucket -> the median over rollouts of its seconds, tokens and row steps (each
  summed over the rollout's segments in that bucket; 0 where a rollout never ran it).

  Medians, where side_by_side.by_bucket takes means: whole rollouts of the real model spread
  by up to ~13% between repeats on this CPU, and one slow repeat should not move a bucket."""
  buckets = sorted({s.batch for segments in rollouts for s in segments}, reverse=True)
  total = lambda segments, batch, key: sum(getattr(s, key) for s in segments
                                           if s.batch == batch)
  return {batch: {key: statistics.median(total(segments, batch, key) for segments in rollouts)
                  for key in QUANTITIES} for batch in buckets}


def summary(segments: dict, summaries: dict, prices: dict) -> dict:
  # Bucket keys as results.json has them, so a report drawn again from the file is the same.
  buckets = {variant: {str(b): row for b, row in by_bucket(rollouts).items()}
             for variant, rollouts in segments.items()}
  seconds = {variant: statistics.median(sum(s.seconds for s in rollout) for rollout in rollouts)
             for variant, rollouts in segments.items()}
  return {'repeats': len(segments[BASELINE]), 'buckets': buckets,
          'rollout_seconds': seconds,
          'speedup': {v: seconds[BASELINE] / s for v, s in seconds.items()
                      if v != BASELINE and s},
          'tau': {v: s['tau'] for v, s in summaries.items()},
          'tree_step_share': {v: s.get('tree_step_share') for v, s in summaries.items()},
          'tree_step_costs': prices}


def report(c, data: dict) -> Result:
  other = c.variants[1]  # the headline variant, as in the end-to-end benchmark
  base, spec = data['buckets'][BASELINE], data['buckets'][other]
  rate = lambda row: row['tokens'] / row['seconds'] if row and row['seconds'] else 0.0
  cells = lambda row: ([f"{row['seconds']:.2f}", f'{rate(row):.1f}'] if row else ['-', '-'])
  ratio = lambda b: (f'{rate(spec[b]) / rate(base[b]):.2f}'
                     if b in spec and rate(base.get(b)) else '-')
  rows = [[b, *cells(base.get(b)), *cells(spec.get(b)), ratio(b)]
          for b in sorted(set(base) | set(spec), key=int, reverse=True)]
  prices = ', '.join(f'{cost:.2f} at {batch}' for batch, cost in data['tree_step_costs'][other])
  text = (f"The first step's rollout ({c.rollout.prompts_per_step} prompts x "
          f"{c.rollout.group_size}), medians of {data['repeats']} timed rollouts each, in "
          f"alternation after one that compiled. {other}'s decode loops ran at "
          f"{data['speedup'][other]:.2f}x of {BASELINE}'s speed (the driver's segments: "
          f"prefill and the gathers between buckets left out), tau {data['tau'][other]:.3f}, "
          f"tree steps {data['tree_step_share'][other]:.1%} of row steps; the gate's price of "
          f"a tree step, in plain steps: {prices} rows.")
  table = Table(['bucket', f'{BASELINE} s', f'{BASELINE} tokens/s', f'{other} s',
                 f'{other} tokens/s', 'tokens/s ratio'], rows)
  return Result(title=f'One GRPO rollout by batch bucket: {BASELINE} / {other}',
                command=command_line('experiments.profile.buckets'), data=data,
                body=[text, table],
                figures=[Figure('buckets.png', 'seconds per batch bucket',
                                lambda fig: plot_buckets(fig, data['buckets']))])


def plot_buckets(fig, buckets: dict) -> None:
  ax = fig.subplots()
  batches = sorted({b for per_variant in buckets.values() for b in per_variant}, key=int,
                   reverse=True)
  width = 0.8 / len(buckets)
  for i, (variant, per_bucket) in enumerate(buckets.items()):
    ax.bar(np.arange(len(batches)) + i * width,
           [per_bucket.get(b, {}).get('seconds', 0.0) for b in batches], width, label=variant)
  ax.set_xticks(np.arange(len(batches)) + width * (len(buckets) - 1) / 2, batches)
  ax.set(xlabel='batch bucket (rows)', ylabel='seconds (median)')
  ax.legend()
