"""The end-to-end benchmark: speculative variants stepped in turn with vanilla learn what it
learns, bit for bit, and the benchmark sees it when they do not."""
import copy
import json
from pathlib import Path

import numpy as np
import pytest

from experiments.bench import e2e
from experiments.lib.results import write
from specroll_jax.speculative.drafter import DrafterConfig, init_drafter, save_drafter
from tests.rl.test_trainer import _config


@pytest.fixture(scope='module')
def stepped(tmp_path_factory, stories_policy):
  tmp = tmp_path_factory.mktemp('e2e')
  drafter = DrafterConfig()
  save_drafter(tmp / 'drafter', drafter,
               init_drafter(drafter, stories_policy.config,
                            np.arange(stories_policy.config.vocab_size)))
  # No gate: every step verifies a tree, so the compared learning went through the walk.
  c = _config(steps=2, rollout__proposers='drafter', rollout__speculation_gate=False)
  c.variants = ('vanilla', 'specroll:static')
  c.proposer_dir, c.workdir, c.out_dir = str(tmp / 'drafter'), str(tmp / 'runs'), str(tmp / 'out')
  rows, states = e2e.step_in_turn(c, e2e.build_runs(c))
  return c, rows, states


def test_variants_learn_bit_for_bit_what_vanilla_learns(stepped):
  c, rows, states = stepped
  data = e2e.summary(c, rows, states)
  assert data['learning_bitwise_equal'] and data['audit_breaks'] == 0, data['learning']
  assert all(r['tree_step_share'] == 1.0 for r in rows['specroll:static'])
  assert data['rows_at_start'] == 16 and 0.0 <= rows['vanilla'][0]['tail_decode_share'] <= 1.0
  # The placed drafter is what the run loaded (a warm start would have written its own).
  placed = Path(c.workdir) / 'specroll_static' / 'drafter' / DrafterConfig.weights_file
  assert placed.read_bytes() == (Path(c.proposer_dir) / DrafterConfig.weights_file).read_bytes()
  write(e2e.report(c, data), c.out_dir)
  written = json.loads((Path(c.out_dir) / 'results.json').read_text())
  assert written['learning_bitwise_equal'] is True and written['steps'] == 2


def test_a_step_that_learned_differently_is_reported(stepped):
  c, rows, states = stepped
  changed = copy.deepcopy(rows)
  changed['specroll:static'][1]['grad_norm'] += 1e-7
  data = e2e.summary(c, changed, states)
  assert not data['learning_bitwise_equal']
  assert data['learning']['specroll:static']['differing_steps'] == [2]


def test_variant_names_are_checked(stepped):
  c = copy.deepcopy(stepped[0])
  with pytest.raises(ValueError, match="config variants: 'vanilla:static'"):
    e2e.variant_config(c, 'vanilla:static')
  c.variants = ('specroll',)
  with pytest.raises(ValueError, match="config variants must start with 'vanilla'"):
    e2e.build_runs(c)
