"""The end-to-end benchmark: speculative variants stepped in turn with vanilla learn what it
learns, bit for bit, and the benchmark sees it when they do not."""
import copy
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from experiments.bench import e2e
from experiments.lib import variant_runs
from experiments.lib.results import write
from specroll_jax.rl.metrics import tail_metrics
from specroll_jax.rollout.driver import Segment
from specroll_jax.speculative.drafter import DrafterConfig, init_drafter, save_drafter
from tests.rl.test_trainer import _config


def _bench_config(tmp, **overrides):
  # No gate: every step verifies a tree, so the compared learning went through the walk.
  c = _config(steps=2, rollout__proposers='drafter', rollout__speculation_gate=False,
              **overrides)
  c.variants = ('vanilla', 'specroll:static')
  c.proposer_dir, c.workdir, c.out_dir = str(tmp / 'drafter'), str(tmp / 'runs'), str(tmp / 'out')
  return c


@pytest.fixture(scope='module')
def stepped(tmp_path_factory, stories_policy):
  tmp = tmp_path_factory.mktemp('e2e')
  drafter = DrafterConfig()
  save_drafter(tmp / 'drafter', drafter,
               init_drafter(drafter, stories_policy.config,
                            np.arange(stories_policy.config.vocab_size)))
  c = _bench_config(tmp)
  rows, states = e2e.step_in_turn(c, variant_runs.build_runs(c, c.workdir))
  return c, rows, states


def test_variants_learn_bit_for_bit_what_vanilla_learns(stepped):
  c, rows, states = stepped
  data = e2e.summary(c, rows, states)
  assert data['learning_bitwise_equal'] and data['audit_breaks'] == 0, data['learning']
  assert all(r['tree_step_share'] == 1.0 for r in rows['specroll:static'])
  assert data['rows_at_start'] == 16
  # The placed drafter is what the run loaded (a warm start would have written its own).
  placed = Path(c.workdir) / 'specroll_static' / 'drafter' / DrafterConfig.weights_file
  assert placed.read_bytes() == (Path(c.proposer_dir) / DrafterConfig.weights_file).read_bytes()
  write(e2e.report(c, data), c.out_dir, tensorboard_dir=Path(c.workdir) / 'tensorboard')
  written = json.loads((Path(c.out_dir) / 'results.json').read_text())
  assert written['learning_bitwise_equal'] is True and written['steps'] == 2


def test_a_step_that_learned_differently_is_reported(stepped):
  c, rows, states = stepped
  changed = copy.deepcopy(rows)
  step_2 = changed['specroll:static'][1]
  step_2['grad_norm'] = float(np.nextafter(step_2['grad_norm'], np.inf))
  data = e2e.summary(c, changed, states)
  assert not data['learning_bitwise_equal'] and data['audit_breaks'] == 0
  assert data['learning']['specroll:static']['learning_differs_at'] == [2]
  changed['specroll:static'][0]['rollout_digest'] = 'another rollout'
  assert e2e.summary(c, changed, states)['audit_breaks'] == 1


def test_a_final_policy_that_differs_is_reported(stepped):
  c, rows, states = stepped
  spec = states['specroll:static']
  leaves, tree = jax.tree.flatten(spec.policy)
  leaves[0] = np.asarray(leaves[0]).copy()
  leaves[0].flat[0] = np.nextafter(leaves[0].flat[0], np.inf)
  changed = {**states, 'specroll:static': spec.replace(policy=jax.tree.unflatten(tree, leaves))}
  data = e2e.summary(c, rows, changed)
  assert not data['learning']['specroll:static']['final_policy_bitwise_equal']
  assert not data['learning_bitwise_equal']


def test_variants_and_steps_are_checked_before_any_run(tmp_path):
  c = _bench_config(tmp_path)
  with pytest.raises(ValueError, match="config variants: 'vanilla:static'"):
    variant_runs.variant_config(c, 'vanilla:static')
  for variants in [('specroll',), ('vanilla', 'specroll', 'specroll')]:
    c.variants = variants
    with pytest.raises(ValueError, match="config variants must start with 'vanilla'"):
      variant_runs.build_runs(c, c.workdir)
  c.steps = 1
  with pytest.raises(ValueError, match='config steps must be >= 2'):
    e2e.check_steps(c)
  assert not (tmp_path / 'runs').exists()


def test_tail_share_counts_the_decode_seconds_of_small_buckets():
  segments = [Segment(batch=32, running=30, seconds=6.0, tokens=0, row_steps=0),
              Segment(batch=16, running=16, seconds=2.0, tokens=0, row_steps=0),
              Segment(batch=4, running=4, seconds=1.5, tokens=0, row_steps=0),
              Segment(batch=2, running=2, seconds=0.5, tokens=0, row_steps=0)]
  assert tail_metrics(segments) == {'rows_at_start': 30, 'tail_decode_share': 0.2}
