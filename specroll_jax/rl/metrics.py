"""A GRPO run's metrics: one JSON line per step in workdir/metrics.jsonl, built by one
function, and the same numbers as TensorBoard scalars in workdir/tensorboard
(`tensorboard --logdir workdir`)."""
import json
import math
import numbers
from pathlib import Path

import numpy as np
from tensorboardX import SummaryWriter

from specroll_jax.rl.phases import PhaseTimer
from specroll_jax.rl.resources import process_memory
from specroll_jax.rl.rollouts import rollout_digest

METRICS_FILE = 'metrics.jsonl'
EVENTS_DIR = 'tensorboard'
# Speculation's per-response reports that go into a step's line as they are.
SUMMARY_PREFIXES = ('reflex_', 'group_')


# The tail's buckets: the few last responses of a GRPO batch, where decode time is spent on
# rows that leave the matrix unit idle and speculation has the most room per row.
TAIL_BUCKET_ROWS = 4


def tail_metrics(segments) -> dict:
  """From a rollout's driver segments: the rows its first on-device loop ran, and the share
  of its decode seconds spent in buckets of <= TAIL_BUCKET_ROWS rows.

  The share depends on the engine, not only on the responses' lengths: a tree step moves
  rows by different amounts, so rows that vanilla brings to the cap in one iteration reach it
  in several under SpecRoll, whose batch then steps down into buckets vanilla never visits."""
  seconds = sum(s.seconds for s in segments)
  tail = sum(s.seconds for s in segments if s.batch <= TAIL_BUCKET_ROWS)
  return {'rows_at_start': segments[0].running,
          'tail_decode_share': tail / seconds if seconds else 0.0}


def step_metrics(step: int, scores: np.ndarray, responses, summary: dict, segments,
                 update: dict, adaptation: dict, checks: dict, timer: PhaseTimer) -> dict:
  """A step's line: rewards, the rollout (its summary from the engine, its digest and its
  tail), the learned proposer's adaptation, the checks (audit, held-out evaluation), the
  update, each phase's seconds, the step's compilations and the process's memory."""
  return {'step': step, 'reward': float(scores.mean()),
          'accuracy': float((scores == 1.0).mean()),
          'response_length': summary['tokens'] / len(responses),
          'tau': summary['tau'], 'acceptance_by_depth': summary.get('acceptance_by_depth'),
          'tree_step_share': summary.get('tree_step_share'),
          'rollout_digest': rollout_digest(responses), **tail_metrics(segments),
          **{k: v for k, v in summary.items() if k.startswith(SUMMARY_PREFIXES)},
          **adaptation, **checks, **update,
          **{f'time_{k}': v for k, v in timer.seconds.items()},
          'compilations': timer.compilations(), **process_memory()}


def truncate_metrics(path: Path, last_step: int) -> None:
  """Drops metric lines after the restored step (written before an interruption), and a
  last line a kill cut short (every complete line ends with a newline)."""
  if path.exists():
    lines = path.read_text().split('\n')[:-1]
    keep = [line for line in lines if json.loads(line)['step'] <= last_step]
    tmp = path.with_name(path.name + '.tmp')
    tmp.write_text(''.join(line + '\n' for line in keep))
    tmp.replace(path)


def scalars(row: dict) -> dict:
  """The entries of a step's line TensorBoard can plot: finite numbers (lists, such as the
  acceptance by depth, stay in metrics.jsonl)."""
  return {k: float(v) for k, v in row.items()
          if isinstance(v, numbers.Real) and k != 'step' and math.isfinite(v)}


class MetricsLog:
  """Appends step lines on the primary process; a resumed run first drops what the restored
  checkpoint does not cover, in both records (TensorBoard hides the steps after
  `restored_step` that an interrupted run wrote to its event files: `purge_step`)."""

  def __init__(self, path: Path, restored_step: int, primary: bool):
    self.path, self.primary, self.events = path, primary, None
    if primary:
      truncate_metrics(path, restored_step)
      self.events = SummaryWriter(str(path.parent / EVENTS_DIR), purge_step=restored_step + 1)

  def append(self, row: dict) -> None:
    if self.primary:
      with self.path.open('a') as f:
        f.write(json.dumps(row) + '\n')
      for tag, value in scalars(row).items():
        self.events.add_scalar(tag, value, row['step'])
      self.events.flush()

  def close(self) -> None:
    if self.events is not None:
      self.events.close()
