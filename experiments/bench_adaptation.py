"""Head-adaptation ablation: the same seeded GRPO run with every variant, in one process.

  python -m experiments.bench_adaptation --config=configs/ablation_w1.py

Variants (trainer.ADAPTATION_MODES): static heads, always-online retraining, Reflex only,
slow path only, both. Every variant starts from the same policy, data, seed and warm-started
heads (trained once, copied), and emits the same tokens (their rollout digests are
compared). Times are sums over the steps after `warmup_steps` (the first steps compile the
engine's shapes, including the compaction gathers as rows first finish); tau is per step.
"""
import json
import shutil
import sys
from pathlib import Path

import matplotlib
import numpy as np
from absl import app
from ml_collections import config_flags

from experiments.common import run_fresh, totals

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/ablation_w1.py')


def run_variant(c, name: str, heads_source: Path | None) -> list[dict]:
  run = c.copy_and_resolve_references()
  workdir = Path(c.workdir) / name
  if name == 'vanilla':
    run.rollout.engine = 'vanilla'
  else:
    run.adaptation.mode = name
    if heads_source is not None and not (workdir / 'heads').exists():
      shutil.copytree(heads_source, workdir / 'heads')
  return run_fresh(run, workdir)


def variant_result(rows, window: int, warmup: int) -> dict:
  tau = [r['tau'] for r in rows]
  t = totals(rows, warmup)
  triggers = [(r['step'], r['triggered']) for r in rows if r.get('triggered')]
  return {
      'tau_mean': float(np.mean(tau)), 'tau_first20': float(np.mean(tau[:window])),
      'tau_last20': float(np.mean(tau[-window:])),
      'time_end_to_end_s': t['end_to_end'], 'time_generation_s': t['rollout'],
      'time_head_updates_s': t['head_update'], 'time_update_s': t['update'],
      'first_step_s': t['first_step'],
      'trigger_events': [{'step': s, 'heads': h} for s, h in triggers],
      'tau_by_step': tau,
      'head_acceptance_by_step': [r.get('head_acceptance') for r in rows],
      'reflex_gate_by_step': [r.get('reflex_gate') for r in rows],
      'reflex_alignment_by_step': [r.get('reflex_alignment') for r in rows],
      'drift_kl_by_step': [r.get('drift_kl') for r in rows],
      'reward_by_step': [r['reward'] for r in rows],
      'rollout_digests': [r['rollout_digest'] for r in rows],
  }


def targets(result: dict) -> list[str]:
  """The issue's targets, each with the measured values and whether it is met."""
  v = result['variants']
  lines = []
  for metric, key in (('tau', 'tau_mean'), ('end-to-end time', 'time_end_to_end_s')):
    better = (lambda a, b: a > b) if key == 'tau_mean' else (lambda a, b: a < b)
    value = lambda name: v[name][key]
    order = (better(value('both'), value('reflex')) and better(value('both'), value('slow'))
             and better(value('reflex'), value('static')) and better(value('slow'), value('static')))
    lines.append(f"- both > reflex, slow > static on {metric}: "
                 f"{'met' if order else 'missed'} (" + ', '.join(
                     f'{n} {value(n):.3f}' for n in ('both', 'reflex', 'slow', 'static')) + ')')
  ratio = v['online']['time_end_to_end_s'] / v['both']['time_end_to_end_s']
  lines.append(f"- both >= 1.2x faster end to end than online: "
               f"{'met' if ratio >= 1.2 else 'missed'} ({ratio:.2f}x)")
  keep = lambda name: v[name]['tau_last20'] / v[name]['tau_first20']
  lines.append(f"- tau_last20 / tau_first20 >= 0.9 for both: "
               f"{'met' if keep('both') >= 0.9 else 'missed'} ({keep('both'):.3f})")
  lines.append(f"- static falls below 0.75: {'met' if keep('static') < 0.75 else 'missed'} "
               f"({keep('static'):.3f})")
  return lines


def write_outputs(c, result: dict, out: Path) -> str:
  variants = result['variants']
  lines = ['| variant | tau mean | tau first20 | tau last20 | last/first | generation s | '
           'head updates s | end-to-end s | triggers |', '|---|' + '---:|' * 8]
  for name, v in variants.items():
    ratio = v['tau_last20'] / v['tau_first20']
    lines.append(f"| {name} | {v['tau_mean']:.3f} | {v['tau_first20']:.3f} | "
                 f"{v['tau_last20']:.3f} | {ratio:.3f} | {v['time_generation_s']:.1f} | "
                 f"{v['time_head_updates_s']:.1f} | {v['time_end_to_end_s']:.1f} | "
                 f"{len(v['trigger_events'])} |")
  speed = result['speedups']
  agreement = ''
  if result.get('vanilla_rollout_digests'):
    same_steps = {name: next((i for i, (a, b) in enumerate(
        zip(v['rollout_digests'], result['vanilla_rollout_digests'])) if a != b),
        len(v['rollout_digests'])) for name, v in variants.items()}
    agreement = (' Steps whose rollouts equal vanilla\'s before the first difference (a '
                 'sampling float near-tie changes one token, and the runs then train on '
                 'different data): ' + ', '.join(f'{n} {k}' for n, k in same_steps.items()) + '.')
  summary = '\n'.join(f'- {k}: {v:.3f}x' for k, v in speed.items())
  (out / 'README.md').write_text(
      f"# Head-adaptation ablation (W1)\n\nCommand: `{result['command']}`\n\n"
      f"{c.steps} GRPO steps, {c.rollout.prompts_per_step} prompts x {c.rollout.group_size} "
      f"samples x <= {c.rollout.max_new_tokens} tokens; drift KL(current || initial) at the "
      f"last step {result['drift_kl_last']:.3f} nats/token; identical rollouts across "
      f"variants: {result['identical_rollouts']}.{agreement}\n\n" + '\n'.join(lines)
      + f"\n\nTimes are summed over steps {c.warmup_steps + 1}..{c.steps}. End-to-end ratios:\n{summary}"
      + '\n\nTargets:\n' + '\n'.join(targets(result)) + '\n\n![tau](tau.png)\n')
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  for name, v in variants.items():
    ax1.plot(range(1, len(v['tau_by_step']) + 1), v['tau_by_step'], label=name)
  ax1.set(xlabel='GRPO step', ylabel='tau (tokens per policy forward)')
  ax1.legend()
  drift = next(iter(variants.values()))['drift_kl_by_step']
  ax2.plot(range(1, len(drift) + 1), drift)
  ax2.set(xlabel='GRPO step', ylabel='KL(current || initial) per token')
  fig.tight_layout()
  fig.savefig(out / 'tau.png', dpi=100)
  return '\n'.join(lines) + '\n' + summary


def main(argv):
  del argv
  c = _CONFIG.value
  runs, heads_source = {}, None
  for name in c.variants:
    runs[name] = run_variant(c, name, heads_source)
    heads_source = heads_source or Path(c.workdir) / name / 'heads'
  if c.include_vanilla:
    runs['vanilla'] = run_variant(c, 'vanilla', None)
  variants = {name: variant_result(rows, c.window, c.warmup_steps) for name, rows in runs.items()
              if name != 'vanilla'}
  digests = {name: [r['rollout_digest'] for r in rows] for name, rows in runs.items()}
  end_to_end = {name: totals(rows, c.warmup_steps)['end_to_end'] for name, rows in runs.items()}
  speedups = {f'{name} vs online': end_to_end['online'] / t for name, t in end_to_end.items()
              if name not in ('online', 'vanilla') and 'online' in end_to_end}
  if 'vanilla' in end_to_end:
    speedups.update({f'{name} vs vanilla': end_to_end['vanilla'] / t
                     for name, t in end_to_end.items() if name != 'vanilla'})
  result = {
      'command': ' '.join(['python -m experiments.bench_adaptation'] + sys.argv[1:]),
      'steps': c.steps, 'variants': variants, 'speedups': speedups,
      'time_end_to_end_s': end_to_end,
      'identical_rollouts': len({tuple(d) for d in digests.values()}) == 1,
      'vanilla_rollout_digests': digests.get('vanilla'),
      'drift_kl_last': next(iter(variants.values()))['drift_kl_by_step'][-1],
  }
  out = Path(c.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  (out / 'results.json').write_text(json.dumps(result, indent=2) + '\n')
  print(write_outputs(c, result, out))


if __name__ == '__main__':
  app.run(main)
