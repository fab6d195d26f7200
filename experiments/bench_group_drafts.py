"""Group drafts against the heads alone: tau at a fixed budget and the gated speedup.

  python -m experiments.bench_group_drafts --config=configs/group_drafts.py

For each workload the engines (vanilla, heads, group drafts alone, both) run side by side in
this process on the same prompts and seed, twice: every step a tree (tau, acceptance by
source, the cost of matching), then with the speculation gate priced on the workload (the
speedup a run would get). Writes results.json, README.md and tau_speedup.png to out_dir.
"""
import json
import sys
from pathlib import Path

import jax
import matplotlib
import numpy as np
from absl import app
from ml_collections import config_flags

from specroll_jax import load_policy
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.spec.factory import tree_config
from specroll_jax.tasks.default_policy import ensure_default_policy
from experiments.side_by_side import compare
from experiments.workloads import benchmark_prompts, warm_started_heads

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/group_drafts.py')
SPECULATIVE = ('specroll', 'group', 'both')
# Per-engine numbers kept in results.json (besides the per-run detail).
KEPT = ('tau', 'speedup', 'median_seconds', 'identical_fraction', 'identical_responses',
        'tree_step_share', 'mean_tree_nodes', 'acceptance_by_depth', 'accepted_per_tree_step',
        'group_acceptance', 'group_calibration', 'group_match_rate', 'group_chain_tokens',
        'group_accepted_per_tree_step')


def accepted_per_tree_step(result: dict) -> float:
  """Draft tokens the verifier accepted per tree step, whichever source drafted them."""
  tree_steps = result['tree_step_share'] * result['row_forwards']
  return float(np.sum(result['accepted_by_depth'])) / max(tree_steps, 1.0)


def run_workload(c, names):
  if not c.checkpoint:
    c.checkpoint = str(ensure_default_policy(c.policy_cache_dir))
  policy = load_policy(c.checkpoint, c.dtype)
  heads_config, heads = warm_started_heads(policy, c)
  tree = tree_config(policy, max_nodes=c.max_nodes, capacity_tokens=c.capacity_tokens,
                     per_batch_capacity=c.capacity_per_batch)
  prompts = benchmark_prompts(policy, c)
  sampler = SamplerConfig(temperature=c.temperature)
  runs = {}
  prices = {}
  for mode, gate in (('fixed_budget', False), ('gated', True)):
    c.speculation_gate = gate
    jax.clear_caches()  # each compare compiles its own engines (memory maps, see bench_rollout)
    result = compare(policy, heads_config, heads, prompts, c.samples_per_prompt, c, tree,
                     sampler, prices, names)
    for name in SPECULATIVE:
      if name in result:
        result[name]['accepted_per_tree_step'] = accepted_per_tree_step(result[name])
    runs[mode] = result
  return runs, prices, len(prompts)


def main(argv):
  del argv
  c = _CONFIG.value
  names = tuple(c.engines)
  if names[0] != 'vanilla' or 'specroll' not in names or 'both' not in names:
    raise ValueError(f'config engines must start with vanilla and include specroll and both, '
                     f'got {names}')
  workloads, prices, prompts = {}, {}, {}
  for key, workload in c.workloads.items():
    print(f'== {key}', file=sys.stderr)
    workloads[key], prices[key], prompts[key] = run_workload(workload, names)
    for name in names[1:]:
      f, g = workloads[key]['fixed_budget'][name], workloads[key]['gated'][name]
      print(f"{key} {name}: tau {f['tau']:.3f}, fixed-budget speedup {f['speedup']:.2f}x, "
            f"gated speedup {g['speedup']:.2f}x", file=sys.stderr)
  identical = [r[name]['identical_responses'] for runs in workloads.values()
               for r in runs.values() for name in names if name != 'vanilla']
  responses = [c.workloads[key].samples_per_prompt * prompts[key]
               for key, runs in workloads.items() for r in runs.values()
               for name in names if name != 'vanilla']
  fixed = lambda key, name, field: workloads[key]['fixed_budget'][name][field]
  gated = lambda key, name: workloads[key]['gated'][name]['speedup']
  result = {
      'command': ' '.join(['python -m experiments.bench_group_drafts'] + sys.argv[1:]),
      'backend': jax.default_backend(),
      'w1_tau_heads': fixed('w1', 'specroll', 'tau'),
      'w1_tau_both': fixed('w1', 'both', 'tau'),
      'w3_tau_heads': fixed('w3', 'specroll', 'tau'),
      'w3_tau_both': fixed('w3', 'both', 'tau'),
      'w3_speedup_both': gated('w3', 'both'),
      'w1_speedup_both': gated('w1', 'both'),
      'identical_fraction': sum(identical) / sum(responses),
      'workloads': {key: {mode: {name: {k: r[name][k] for k in KEPT if k in r[name]}
                                 for name in names}
                          for mode, r in runs.items()}
                    for key, runs in workloads.items()},
      'tree_step_costs': prices,
      'config': c.to_dict(),
  }
  out = Path(c.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  (out / 'results.json').write_text(json.dumps(result, indent=2, default=float) + '\n')
  lines = ['| workload | engine | tau (fixed budget) | speedup (fixed budget) | speedup (gated) | '
           'gated tree steps | accepted / tree step | on chains / tree step | chain acceptance '
           '| match rate | identical responses |',
           '|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|']
  for key, runs in workloads.items():
    for name in names[1:]:
      f, g = runs['fixed_budget'][name], runs['gated'][name]
      chains = lambda field: f"{f[field]:.3f}" if field in f else '-'
      lines.append(f"| {key} | {name} | {f['tau']:.2f} | {f['speedup']:.2f}x | "
                   f"{g['speedup']:.2f}x | {g['tree_step_share']:.2f} | "
                   f"{f['accepted_per_tree_step']:.2f} | {chains('group_accepted_per_tree_step')} | "
                   f"{chains('group_acceptance')} | {chains('group_match_rate')} | "
                   f"{f['identical_responses']}+{g['identical_responses']} |")
  (out / 'README.md').write_text(
      f"# Group drafts (W1, W3)\n\nCommand: `{result['command']}` (backend "
      f"{jax.default_backend()}). 'specroll' is the heads alone. Identical responses: fixed-"
      "budget + gated runs.\n\n" + '\n'.join(lines) + '\n\n![tau and speedup](tau_speedup.png)\n')
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  width = 0.8 / len(workloads)
  for i, (key, runs) in enumerate(workloads.items()):
    x = np.arange(len(names) - 1) + i * width
    axes[0].bar(x, [runs['fixed_budget'][n]['tau'] for n in names[1:]], width, label=key)
    axes[1].bar(x, [runs['gated'][n]['speedup'] for n in names[1:]], width, label=key)
  for ax, label in zip(axes, ('tau at a fixed budget', 'gated speedup over vanilla')):
    ax.set_xticks(np.arange(len(names) - 1) + width * (len(workloads) - 1) / 2, names[1:])
    ax.set_ylabel(label)
    ax.legend()
  axes[1].axhline(1.0, color='gray', lw=0.5)
  fig.tight_layout()
  fig.savefig(out / 'tau_speedup.png', dpi=100)
  print('\n'.join(lines))


if __name__ == '__main__':
  app.run(main)
