"""Group drafts against the heads alone: tau at a fixed budget and the gated speedup.

  python -m experiments.bench.group_drafts --config=configs/group_drafts.py

For each workload the engines (vanilla, heads, group drafts alone, both) run side by side in
this process on the same prompts and seed, twice: every step a tree (tau, acceptance by
source, the cost of matching), then with the speculation gate priced on the workload (the
speedup a run would get). Writes results.json, README.md and tau_speedup.png to out_dir.
"""
import json
import sys
from pathlib import Path

import jax
import numpy as np
from absl import app
from ml_collections import config_flags

from specroll_jax import load_policy
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.factory import tree_config
from specroll_jax.tasks.default_policy import ensure_default_policy
from experiments.lib.results import Figure, Result, Table, command_line, write, write_json
from experiments.lib.side_by_side import compare
from experiments.lib.workloads import benchmark_prompts, warm_started_drafts

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


def run_workload(c, names, modes):
  if not c.checkpoint:
    c.checkpoint = str(ensure_default_policy(c.policy_cache_dir))
  policy = load_policy(c.checkpoint, c.dtype)
  drafts = warm_started_drafts(policy, c)
  tree = tree_config(policy, max_nodes=c.max_nodes, capacity_tokens=c.capacity_tokens,
                     per_batch_capacity=c.capacity_per_batch)
  prompts = benchmark_prompts(policy, c)
  sampler = SamplerConfig(temperature=c.temperature)
  runs = {}
  prices = {}
  for mode in modes:
    c.speculation_gate = mode == 'gated'
    jax.clear_caches()  # each compare compiles its own engines (memory maps, see bench_rollout)
    result = compare(policy, drafts, prompts, c.samples_per_prompt, c, tree,
                     sampler, prices, names)
    for name in SPECULATIVE:
      if name in result:
        result[name]['accepted_per_tree_step'] = accepted_per_tree_step(result[name])
    runs[mode] = result
  return {'runs': runs, 'prices': {name: p.tree_step_costs for name, p in prices.items()},
          'responses': len(prompts) * c.samples_per_prompt}


def merged_with_earlier(earlier: dict, measured: dict, path: Path) -> dict:
  """The modes measured now, added to those an earlier run of the same workload measured.

  A mode takes a workload's whole time budget, so fixed-budget and gated runs may come from
  separate processes; they are only combined when the workload config is the same but for
  the gate the mode sets (the engines' compiled shapes and inputs then are too).
  """
  config = json.loads(json.dumps(measured['config'], default=float))
  changed = sorted(k for k in set(config) | set(earlier['config'])
                   if k != 'speculation_gate' and config.get(k) != earlier['config'].get(k))
  if changed:
    raise ValueError(f'{path} was measured with another workload config (fields {changed}); '
                     f'move it away to measure this one')
  kept = {mode: run for mode, run in earlier['runs'].items() if mode not in measured['runs']}
  return dict(measured, runs={**kept, **measured['runs']},
              commands={**earlier['commands'], **measured['commands']},
              prices={**earlier['prices'], **measured['prices']})


def main(argv):
  del argv
  c = _CONFIG.value
  names = tuple(c.engines)
  if names[0] != 'vanilla' or 'specroll' not in names or 'both' not in names:
    raise ValueError(f'config engines must start with vanilla and include specroll and both, '
                     f'got {names}')
  out = Path(c.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  command = command_line('experiments.bench.group_drafts')
  # One file per workload, written as soon as it is measured: a later workload that fails
  # (or a run of only some workloads, c.run) leaves the others' results in place.
  for key in c.run:
    print(f'== {key}', file=sys.stderr)
    measured = run_workload(c.workloads[key], names, tuple(c.modes))
    measured.update(commands={mode: command for mode in measured['runs']},
                    config=c.workloads[key].to_dict())
    path = out / f'{key}.json'
    if path.exists():
      measured = merged_with_earlier(json.loads(path.read_text()), measured, path)
    write_json(path, measured)
  measured = {key: json.loads((out / f'{key}.json').read_text()) for key in c.workloads
              if (out / f'{key}.json').exists()}
  write(report(names, measured, command), out)


def summary(names, measured) -> dict:
  workloads = {key: m['runs'] for key, m in measured.items()}
  identical = [r[name]['identical_responses'] for runs in workloads.values()
               for r in runs.values() for name in names if name != 'vanilla']
  responses = [measured[key]['responses'] for key, runs in workloads.items()
               for r in runs.values() for name in names if name != 'vanilla']
  value = lambda key, mode, name, field: (workloads[key][mode][name][field]
                                          if mode in workloads.get(key, {}) else None)
  return {
      'commands': {key: m['commands'] for key, m in measured.items()},
      'backend': jax.default_backend(),
      'w1_tau_heads': value('w1', 'fixed_budget', 'specroll', 'tau'),
      'w1_tau_both': value('w1', 'fixed_budget', 'both', 'tau'),
      'w3_tau_heads': value('w3', 'fixed_budget', 'specroll', 'tau'),
      'w3_tau_both': value('w3', 'fixed_budget', 'both', 'tau'),
      'w3_speedup_both': value('w3', 'gated', 'both', 'speedup'),
      'w1_speedup_both': value('w1', 'gated', 'both', 'speedup'),
      'identical_fraction': sum(identical) / max(sum(responses), 1),
      'workloads': {key: {mode: {name: {k: r[name][k] for k in KEPT if k in r[name]}
                                 for name in names}
                          for mode, r in runs.items()}
                    for key, runs in workloads.items()},
      'tree_step_costs': {key: m['prices'] for key, m in measured.items()},
  }


def report(names, measured, command) -> Result:
  workloads = {key: m['runs'] for key, m in measured.items()}
  return Result(
      title='Group drafts (W1, W3)', command=command, data=summary(names, measured),
      body=[f'Backend {jax.default_backend()}; each mode\'s command per workload is in '
            "results.json ('commands'). 'specroll' is the heads alone. Identical responses: "
            'fixed-budget + gated runs.', engine_table(names, workloads)],
      figures=[Figure('tau_speedup.png', 'tau and speedup',
                      lambda fig: plot_workloads(fig, names, workloads))])


def engine_table(names, workloads) -> Table:
  missing = {'tau': float('nan'), 'speedup': float('nan'), 'tree_step_share': float('nan'),
             'accepted_per_tree_step': float('nan'), 'identical_responses': '-'}
  rows = []
  for key, runs in workloads.items():
    for name in names[1:]:
      f = runs.get('fixed_budget', {}).get(name, missing)
      g = runs.get('gated', {}).get(name, missing)
      chains = lambda field: f"{f[field]:.3f}" if field in f else '-'
      rows.append([key, name, f"{f['tau']:.2f}", f"{f['speedup']:.2f}x", f"{g['speedup']:.2f}x",
                   f"{g['tree_step_share']:.2f}", f"{f['accepted_per_tree_step']:.2f}",
                   chains('group_accepted_per_tree_step'), chains('group_acceptance'),
                   chains('group_match_rate'),
                   f"{f['identical_responses']}+{g['identical_responses']}"])
  return Table(['workload', 'engine', 'tau (fixed budget)', 'speedup (fixed budget)',
                'speedup (gated)', 'gated tree steps', 'accepted / tree step',
                'on chains / tree step', 'chain acceptance', 'match rate', 'identical responses'],
               rows, align='llrrrrrrrrr')


def plot_workloads(fig, names, workloads) -> None:
  axes = fig.subplots(1, 2)
  width = 0.8 / len(workloads)
  for i, (key, runs) in enumerate(workloads.items()):
    x = np.arange(len(names) - 1) + i * width
    for ax, mode, field in ((axes[0], 'fixed_budget', 'tau'), (axes[1], 'gated', 'speedup')):
      if mode in runs:
        ax.bar(x, [runs[mode][n][field] for n in names[1:]], width, label=key)
  for ax, label in zip(axes, ('tau at a fixed budget', 'gated speedup over vanilla')):
    ax.set_xticks(np.arange(len(names) - 1) + width * (len(workloads) - 1) / 2, names[1:])
    ax.set_ylabel(label)
    ax.legend()
  axes[1].axhline(1.0, color='gray', lw=0.5)


if __name__ == '__main__':
  app.run(main)
