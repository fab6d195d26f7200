"""report.md with PNG plots from a run's metrics.jsonl."""
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402

from specroll_jax.rl.metrics import TAIL_BUCKET_ROWS  # noqa: E402

HELD_OUT_SUMMARY = ('heldout_updates', 'heldout_reward', 'heldout_accuracy')
TIME_KEYS = ('rollout', 'audit', 'evaluation', 'reward', 'logprobs', 'update', 'proposer_update')


def _window_mean(rows, key, window):
  values = [r[key] for r in rows[:window]], [r[key] for r in rows[-window:]]
  return tuple(sum(v) / len(v) for v in values)


def _audit_lines(audits) -> list[str]:
  if not audits:
    return ['No step was audited (audit.every = 0).', '']
  identical = sum(a['audit_identical'] for a in audits)
  responses = sum(a['audit_responses'] for a in audits)
  near_ties = sum(a['audit_near_ties'] for a in audits)
  mismatches = sum(a['audit_mismatches'] for a in audits)
  speedups = [a['audit_speedup'] for a in audits]
  lines = ['## Audit: the vanilla engine replaying the same rollouts', '',
           f'{len(audits)} audited steps: **{identical}/{responses} responses identical** to '
           f'vanilla ({near_ties} float near-ties, {mismatches} contract breaks); generation '
           f'speedup over vanilla median **{statistics.median(speedups):.2f}x** '
           f'(range {min(speedups):.2f}-{max(speedups):.2f}x).', '',
           '| step | identical | near-ties | breaks | vanilla s | speedup |',
           '|---:|---:|---:|---:|---:|---:|']
  lines += [f"| {a['step']} | {a['audit_identical']}/{a['audit_responses']} | "
            f"{a['audit_near_ties']} | {a['audit_mismatches']} | "
            f"{a['audit_vanilla_seconds']:.1f} | {a['audit_speedup']:.2f}x |" for a in audits]
  return lines + ['']


def _held_out_lines(evaluations, reward_rule: str) -> list[str]:
  if not evaluations:
    return []
  rules = sorted(k[len('heldout_'):] for k in evaluations[0]
                 if k.startswith('heldout_') and k not in HELD_OUT_SUMMARY)
  lines = ['## Held-out evaluation (prompts the run never trains on)', '',
           f'Accuracy is reward 1.0 under the run\'s rule ({reward_rule}); every rule\'s mean '
           'reward on the same samples:', '',
           '| updates | accuracy | ' + ' | '.join(rules) + ' |',
           '|---:|---:|' + '---:|' * len(rules)]
  lines += [f"| {e['heldout_updates']} | {e['heldout_accuracy']:.3f} | " +
            ' | '.join(f"{e['heldout_' + rule]:.3f}" for rule in rules) + ' |'
            for e in evaluations]
  return lines + ['']


def _tail_lines(rows) -> list[str]:
  # A run resumed from before these metrics existed has lines without them.
  tails = [r for r in rows if 'tail_decode_share' in r]
  if not tails:
    return []
  share = sum(r['tail_decode_share'] for r in tails) / len(tails)
  return [f"Rollouts start at {tails[0]['rows_at_start']} rows; on average {share:.0%} of a "
          f'rollout\'s decode time is spent in buckets of <= {TAIL_BUCKET_ROWS} rows (the tail).']


def write_report(workdir, window: int = 5, reward_rule: str = 'strict') -> Path:
  """report.md and its plots; rewards and accuracy are compared between the first and the
  last `window` steps."""
  workdir = Path(workdir)
  rows = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()
          if line]
  steps = [r['step'] for r in rows]
  audits = [r for r in rows if 'audit_speedup' in r]
  evaluations = [r for r in rows if 'heldout_updates' in r]
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
  ax1.plot(steps, [r['reward'] for r in rows], label='reward')
  ax1.plot(steps, [r['accuracy'] for r in rows], label='accuracy')
  if evaluations:
    # The policy after k updates is the one step k + 1 starts from.
    ax1.plot([e['heldout_updates'] + 1 for e in evaluations],
             [e['heldout_accuracy'] for e in evaluations], 'o-', label='held-out accuracy')
  ax1.set(xlabel='GRPO step', ylabel='mean over rollouts')
  ax1.legend()
  ax2.plot(steps, [r['tau'] for r in rows], color='C2', label='tau (tokens / policy forward)')
  if audits:
    ax2.plot([a['step'] for a in audits], [a['audit_speedup'] for a in audits], 'o-',
             color='C3', label='audited speedup over vanilla')
  ax2.set(xlabel='GRPO step')
  ax2.legend()
  fig.tight_layout()
  fig.savefig(workdir / 'reward_tau.png', dpi=100)
  plt.close(fig)
  totals = {k: sum(r.get(f'time_{k}', 0.0) for r in rows) for k in TIME_KEYS}
  fig, ax = plt.subplots(figsize=(6, 3))
  ax.barh(list(totals), list(totals.values()))
  ax.set(xlabel='seconds (all steps)')
  fig.tight_layout()
  fig.savefig(workdir / 'time_breakdown.png', dpi=100)
  plt.close(fig)
  window = max(1, min(window, len(rows) // 2))
  first, last = _window_mean(rows, 'reward', window)
  acc_first, acc_last = _window_mean(rows, 'accuracy', window)
  lines = ['# GRPO run report', '',
           f'{len(rows)} steps, reward rule {reward_rule}. Mean reward over the first / last '
           f'{window} steps: '
           f'{first:.3f} -> {last:.3f} ({last - first:+.3f}); accuracy {acc_first:.3f} -> '
           f'{acc_last:.3f}; mean tau {sum(r["tau"] for r in rows) / len(rows):.2f}.',
           *_tail_lines(rows), '',
           *_held_out_lines(evaluations, reward_rule), *_audit_lines(audits),
           '## Time', '', '| phase | seconds | share |', '|---|---:|---:|']
  total = sum(totals.values()) or 1.0
  lines += [f'| {k} | {v:.1f} | {v / total:.1%} |' for k, v in totals.items()]
  lines += ['', '![reward, tau and audited speedup](reward_tau.png)', '',
            '![time breakdown](time_breakdown.png)', '']
  path = workdir / 'report.md'
  path.write_text('\n'.join(lines))
  return path
