"""report.md with PNG plots from a run's metrics.jsonl."""
import json
from pathlib import Path

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402

TIME_KEYS = ('rollout', 'reward', 'logprobs', 'update', 'head_update')


def write_report(workdir) -> Path:
  workdir = Path(workdir)
  rows = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()
          if line]
  steps = [r['step'] for r in rows]
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
  ax1.plot(steps, [r['reward'] for r in rows], label='reward')
  ax1.plot(steps, [r['accuracy'] for r in rows], label='accuracy')
  ax1.set(xlabel='GRPO step', ylabel='mean over rollouts')
  ax1.legend()
  ax2.plot(steps, [r['tau'] for r in rows], color='C2')
  ax2.set(xlabel='GRPO step', ylabel='tau (tokens / policy forward)')
  fig.tight_layout()
  fig.savefig(workdir / 'reward_tau.png', dpi=100)
  plt.close(fig)
  totals = {k: sum(r[f'time_{k}'] for r in rows) for k in TIME_KEYS}
  fig, ax = plt.subplots(figsize=(6, 3))
  ax.barh(list(totals), list(totals.values()))
  ax.set(xlabel='seconds (all steps)')
  fig.tight_layout()
  fig.savefig(workdir / 'time_breakdown.png', dpi=100)
  plt.close(fig)
  last = rows[-1]
  lines = ['# GRPO run report', '',
           f'{len(rows)} steps; final reward {last["reward"]:.3f}, accuracy '
           f'{last["accuracy"]:.3f}, tau {last["tau"]:.2f}.', '',
           '| phase | seconds | share |', '|---|---:|---:|']
  total = sum(totals.values()) or 1.0
  lines += [f'| {k} | {v:.1f} | {v / total:.1%} |' for k, v in totals.items()]
  lines += ['', '![reward and tau](reward_tau.png)', '', '![time breakdown](time_breakdown.png)', '']
  path = workdir / 'report.md'
  path.write_text('\n'.join(lines))
  return path
