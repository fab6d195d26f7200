"""The GRPO trainer: speculation changes nothing in training, and a killed run resumes."""
import json
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs.tiny_math import get_config
from specroll_jax.rl.trainer import STEP_COSTS_FILE, train
from tests.conftest import REPO, STORIES

# stories260K never answers a math question, so rewards (and advantages) are zero; weight
# decay still moves the policy every step, so later rollouts come from changed weights.
SMALL = {'steps': 3, 'checkpoint_every': 1, 'policy.checkpoint': str(STORIES), 'rollout.prompts_per_step': 4,
         'rollout.group_size': 4, 'rollout.max_new_tokens': 20, 'rollout.max_batch': 16,
         'rollout.capacity_tokens': 64, 'grpo.micro_batch_size': 8, 'grpo.weight_decay': 0.5,
         'grpo.learning_rate': 1e-2, 'task.count': 64, 'heads.num_sequences': 16,
         'heads.held_out': 4, 'heads.steps': 5}


def _config(**extra):
  c = get_config()
  for key, value in {**SMALL, **{k.replace('__', '.'): v for k, v in extra.items()}}.items():
    node = c
    *path, leaf = key.split('.')
    for part in path:
      node = node[part]
    node[leaf] = value
  return c


def _metrics(workdir):
  return [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()]


def _final_params(workdir):
  manager = ocp.CheckpointManager((workdir / 'checkpoints').resolve())
  return jax.tree.leaves(manager.restore(manager.latest_step(),
                                         args=ocp.args.StandardRestore())['policy'])


# Forces the slow path to consolidate on every window after the first, so Reflex and head
# updates both run inside the compared training.
ALWAYS_TRIGGER = {'adaptation.monitor.drop': -1.0, 'adaptation.monitor.regret_z': -1e9,
                  'adaptation.monitor.patience': 1, 'adaptation.monitor.cooldown': 0,
                  'adaptation.monitor.calibration_windows': 1,
                  'adaptation.consolidation.steps': 3, 'adaptation.consolidation.batch_size': 4,
                  'adaptation.reflex.gate_threshold': -1.0}


def test_specroll_and_vanilla_training_agree(tmp_path):
  # Prices saved as a resumed run finds them: a tree step priced below one plain step
  # always pays, so every step verifies a tree (pricing itself is tested in test_gate.py).
  (tmp_path / 'spec').mkdir()
  (tmp_path / 'spec' / STEP_COSTS_FILE).write_text(json.dumps([[16, 0.5]]))
  spec = train(_config(rollout__engine='specroll', **{k.replace('.', '__'): v
                                                      for k, v in ALWAYS_TRIGGER.items()}),
               tmp_path / 'spec')
  train(_config(rollout__engine='vanilla'), tmp_path / 'vanilla')
  a, b = _metrics(tmp_path / 'spec'), _metrics(tmp_path / 'vanilla')
  assert [m['rollout_digest'] for m in a] == [m['rollout_digest'] for m in b]
  assert [m['reward'] for m in a] == [m['reward'] for m in b]
  assert spec['tau'] >= 1.0 and (tmp_path / 'spec' / 'report.md').exists()
  assert a[1]['triggered'], a[1]  # window 1 calibrates; window 2 consolidates
  assert all(max(m['reflex_gate']) > 0 for m in a)
  for x, y in zip(_final_params(tmp_path / 'spec'), _final_params(tmp_path / 'vanilla')):
    # Identical tokens and pi_old from the learner (grpo.learner_old_logprobs): the updates
    # are the same computation, bit for bit.
    np.testing.assert_array_equal(x, y)


def _command(workdir):
  overrides = {**SMALL, 'steps': 4, 'rollout.engine': 'vanilla'}
  return [sys.executable, '-m', 'experiments.train_grpo', f'--workdir={workdir}',
          *[f'--config.{k}={v}' for k, v in overrides.items()]]


def test_killed_run_resumes_to_the_same_parameters(tmp_path):
  straight, killed = tmp_path / 'straight', tmp_path / 'killed'
  subprocess.run(_command(straight), cwd=REPO, check=True, capture_output=True)
  process = subprocess.Popen(_command(killed), cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
  deadline = time.time() + 300
  while time.time() < deadline and not (
      (killed / 'metrics.jsonl').exists() and len(_metrics(killed)) >= 2):
    time.sleep(0.2)
  process.send_signal(signal.SIGKILL)
  process.wait()
  assert len(_metrics(killed)) < 4, 'the run finished before it could be interrupted'
  subprocess.run(_command(killed), cwd=REPO, check=True, capture_output=True)
  assert [m['rollout_digest'] for m in _metrics(killed)] == [
      m['rollout_digest'] for m in _metrics(straight)]
  for x, y in zip(_final_params(killed), _final_params(straight)):
    np.testing.assert_array_equal(x, y)


def test_config_pointing_at_a_missing_checkpoint_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match='policy.checkpoint: .*nowhere does not exist'):
    train(_config(policy__checkpoint=str(tmp_path / 'nowhere')), tmp_path / 'run')


def test_prompt_longer_than_the_model_allows_is_a_clear_error(tmp_path):
  with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
    train(_config(rollout__engine='vanilla', rollout__max_new_tokens=480), tmp_path / 'run')
