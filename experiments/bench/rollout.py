"""Rollout benchmark: vanilla vs SpecRoll vs oracle, wall-time ratios.

  python -m experiments.bench.rollout --config=configs/bench_w2.py   (stories260K)
  python -m experiments.bench.rollout --config=configs/bench_w3.py   (SmolLM2 on GSM8K)
  python -m experiments.bench.rollout --config=configs/bench_w4.py   (SmolLM2, the GRPO tail)

SpecRoll drafts with the static warm-started heads, or with `--config.drafts=drafter` (W3,
W4) the sequential drafter (speculative/drafter.py).

All engines run in this process on the same prompts, seed and sampler; each is compiled
once, then timed `repeats` times in alternation, and ratios of medians are reported, for
the whole rollout and per batch bucket (as rows finish, the driver compacts to smaller
buckets: the tail). The oracle's trees are the vanilla rollout's true future as a chain
as deep as SpecRoll's trees, alone, priced and sized like SpecRoll's: the ceiling of this
tree design on this hardware. A sweep over the number of responses gives tau and speedup
against the active batch size. With `hf_generate`, transformers' `generate` (torch) samples
the same prompts with the same sampler; its samples differ (another RNG), so it is compared
in tokens/s.
"""
from pathlib import Path

import jax
import numpy as np
from absl import app
from ml_collections import config_flags

from specroll_jax import load_policy
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.factory import tree_config
from experiments.measure import roofline
from experiments.lib.results import Figure, Result, Table, command_line, write
from experiments.lib.side_by_side import compare
from experiments.lib.workloads import benchmark_prompts, sweep_slice, warm_started_drafts

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/bench_w2.py')
TAIL_ROWS = 4  # buckets of at most this many rows are the GRPO tail


def main(argv):
  del argv
  c = _CONFIG.value
  write(report(c, measure(c)), c.out_dir)


def measure(c) -> dict:
  """The main run (every response of the config) and the sweep over fewer responses, with
  the gate's prices, the tree capacity and the roofline."""
  policy = load_policy(c.checkpoint, c.dtype, compute_dtype=c.compute_dtype)
  drafts = warm_started_drafts(policy, c)
  tree = tree_config(policy, max_nodes=c.max_nodes,
                     capacity_tokens=c.capacity_tokens,
                     per_batch_capacity=c.capacity_per_batch)
  sampler = SamplerConfig(temperature=c.temperature)
  prompts = benchmark_prompts(policy, c)
  samples = c.samples_per_prompt
  prices = {}  # priced on the main run, the largest batch, for every smaller bucket
  main_run = compare(policy, drafts, prompts, samples, c, tree, sampler, prices)
  rows = len(prompts) * samples
  sweep = {}
  for b in c.batch_sweep:
    if b != rows:
      # Each compare compiles its own engines; without this the W3 sweep with the gate's
      # pricing ran out of memory maps (vm.max_map_count 65,530) in its last compile.
      jax.clear_caches()
      sweep[b] = compare(policy, drafts, *sweep_slice(prompts, samples, b), c,
                         tree, sampler, prices)
  sweep[rows] = main_run
  num_params = sum(x.size for x in jax.tree.leaves(policy.params))
  # The roofline's cache holds the mean prompt plus half the mean vanilla response: the
  # average filled cache of a decode step over the rollout.
  mean_response = main_run['vanilla']['tokens_per_s'] * main_run['vanilla']['median_seconds'] / rows
  cache_slots = int(np.mean([len(p) for p in prompts]) + mean_response / 2)
  return {'main_run': main_run, 'sweep': sweep, 'prices': prices,
          'capacity': tree.capacity_by_batch or tree.capacity_tokens,
          'roofline': (roofline.decode_roofline(policy.config, num_params, c.roofline_batch,
                                                cache_slots) if c.roofline_batch else None)}


def summary(c, measured) -> dict:
  main_run, sweep, prices = measured['main_run'], measured['sweep'], measured['prices']
  data = {
      'config': c.to_dict(), 'capacity_tokens': measured['capacity'],
      'backend': jax.default_backend(),
      'tree_step_costs': {name: [list(row) for row in p.tree_step_costs]
                          for name, p in prices.items()},
      'tree_widths': {name: [list(row) for row in p.sized_widths] for name, p in prices.items()},
      'one_projection_batches': {name: list(p.one_projection) for name, p in prices.items()},
      'speedup_generation': main_run['specroll']['speedup'],
      'specroll_speedup': main_run['specroll']['speedup'],
      # Share of vanilla's decode time spent with at most TAIL_ROWS rows in the bucket.
      'tail_share': sum(b['share'] for batch, b in main_run['vanilla']['buckets'].items()
                        if batch <= TAIL_ROWS),
      'tau': main_run['specroll']['tau'],
      'oracle_speedup': main_run['oracle']['speedup'],
      'oracle_tau': main_run['oracle']['tau'],
      'identical_fraction': main_run['specroll']['identical_fraction'],
      'min_speedup_over_batches': min(r['specroll']['speedup'] for r in sweep.values()),
      'engines': main_run,
      'batch_sweep': {str(b): {name: {k: r[name][k] for k in ('tau', 'speedup', 'tokens_per_s',
                                                               'tree_step_share') if k in r[name]}
                               for name in ('vanilla', 'specroll', 'oracle')}
                      for b, r in sorted(sweep.items())},
  }
  if c.hf_generate:
    data['vanilla_vs_hf_generate'] = main_run['vanilla']['vs_hf_generate']
    for b, r in sweep.items():
      data['batch_sweep'][str(b)]['hf_generate_tokens_per_s'] = r['hf_generate']['tokens_per_s']
  if measured['roofline']:
    data['roofline_tokens_per_s'] = measured['roofline']['tokens_per_s']
    data['roofline'] = measured['roofline']
  return data


def report(c, measured) -> Result:
  main_run, sweep = measured['main_run'], measured['sweep']
  return Result(
      title=f'Rollout benchmark ({Path(c.out_dir).name})',
      command=command_line('experiments.bench.rollout'), data=summary(c, measured),
      body=[f"Backend {jax.default_backend()}, C_hw = {measured['capacity']} tokens.",
            engine_table(main_run), '## By batch bucket (the main run)', bucket_table(main_run),
            '## Against the number of responses in the batch', sweep_table(sweep)],
      figures=[Figure('tau_speedup.png', 'tau and speedup', lambda fig: plot_sweep(fig, sweep))])


def engine_table(main_run) -> Table:
  rows = []
  for name, r in main_run.items():
    if name == 'hf_generate':
      rows.append(['hf_generate (torch)', f"{r['median_seconds']:.2f}",
                   f"{r['tokens_per_s']:.1f} tok/s", '-', '-', '-'])
      continue
    rows.append([name, f"{r['median_seconds']:.2f}", f"{r['speedup']:.2f}x", f"{r['tau']:.2f}",
                 f"{r['identical_fraction']:.4f}", r.get('acceptance_by_depth', '-')])
  return Table(['engine', 'median s', 'speedup', 'tau', 'identical tokens', 'accept. by depth'],
               rows, align='lrrrrl')


def sweep_table(sweep) -> Table:
  rows = [[b, f"{r['vanilla']['tokens_per_s']:.1f}", f"{r['specroll']['tau']:.2f}",
           f"{r['specroll']['speedup']:.2f}x", f"{r['specroll']['tree_step_share']:.2f}",
           f"{r['oracle']['tau']:.2f}", f"{r['oracle']['speedup']:.2f}x",
           f"{r['oracle']['tree_step_share']:.2f}"] for b, r in sorted(sweep.items())]
  return Table(['responses', 'vanilla tok/s', 'specroll tau', 'specroll speedup',
                'specroll tree steps', 'oracle tau', 'oracle speedup', 'oracle tree steps'], rows)


def plot_sweep(fig, sweep) -> None:
  batches = sorted(sweep)
  ax1, ax2 = fig.subplots(1, 2)
  for name in ('specroll', 'oracle'):
    ax1.plot(batches, [sweep[b][name]['tau'] for b in batches], 'o-', label=name)
    ax2.plot(batches, [sweep[b][name]['speedup'] for b in batches], 'o-', label=name)
  ax1.set(xlabel='responses in the batch', ylabel='tau (tokens / policy forward)', xscale='log')
  ax2.set(xlabel='responses in the batch', ylabel='speedup over vanilla', xscale='log')
  ax2.axhline(1.0, color='gray', lw=0.5)
  for ax in (ax1, ax2):
    ax.legend()


def bucket_table(run) -> Table:
  """Per batch bucket, vanilla's share of its decode time and tokens/s, and for each
  speculative engine its tree width, price (plain steps), tau and speedup there."""
  speculative = [n for n in ('specroll', 'oracle') if n in run]
  header = ['bucket', 'vanilla share', 'vanilla tok/s'] + [
      f'{n} {what}' for n in speculative for what in ('width', 'price', 'tau', 'speedup')]
  fmt = lambda x, spec: '-' if x is None else format(x, spec)
  rows = []
  for batch, v in sorted(run['vanilla']['buckets'].items()):
    cells = [batch, f"{v['share']:.3f}", f"{v['tokens_per_s']:.1f}"]
    for name in speculative:
      b = run[name]['buckets'].get(batch, {})
      cells += [b.get('width', '-'), fmt(b.get('price'), '.2f'), fmt(b.get('tau'), '.2f'),
                fmt(b.get('speedup'), '.2f')]
    rows.append(cells)
  return Table(header, rows)


if __name__ == '__main__':
  app.run(main)
