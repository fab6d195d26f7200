"""The GRPO trainer: speculation changes nothing in training, and a killed run resumes."""
import json
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import smol_grpo
from configs.tiny_math import get_config
from specroll_jax.rl.metrics import EVENTS_DIR, MetricsLog, scalars, truncate_metrics
from specroll_jax.rl.run import STEP_COSTS_FILE
from specroll_jax.rl.trainer import train
from specroll_jax.speculative.context_drafter import ContextDrafterConfig
from specroll_jax.speculative.drafter import FEATURES, DrafterConfig, load_drafter
from specroll_jax.tasks.rewards import REWARD_RULES
from tests.conftest import FIXTURE_DATA, REPO, STORIES
from tests.tensorboard_events import read_events

# stories260K never answers a math question, so rewards (and advantages) are zero; weight
# decay still moves the policy every step, so later rollouts come from changed weights.
SMALL = {'steps': 3, 'checkpoint_every': 1, 'policy.checkpoint': str(STORIES),
         'rollout.prompts_per_step': 4, 'rollout.group_size': 4,
         'rollout.driver.max_new_tokens': 20, 'rollout.driver.max_batch': 16,
         'rollout.tree.capacity_tokens': 64, 'grpo.micro_batch_size': 8, 'grpo.weight_decay': 0.5,
         'grpo.learning_rate': 1e-2, 'task.count': 64, 'heads.num_sequences': 16,
         'heads.held_out': 4, 'heads.steps': 5, 'drafter.num_sequences': 16,
         'drafter.held_out': 4, 'drafter.training.steps': 5, 'audit.every': 0,
         # One device, as a one-CPU machine runs it (the suite forces 8 host devices).
         'mesh.data': 1}


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


# Both timescales (Reflex is off in the main job's default), the slow path forced to
# consolidate on every window after the first, so Reflex and head updates both run inside
# the compared training.
ALWAYS_TRIGGER = {'adaptation.mode': 'both',
                  'adaptation.monitor.drop': -1.0, 'adaptation.monitor.regret_z': -1e9,
                  'adaptation.monitor.patience': 1, 'adaptation.monitor.cooldown': 0,
                  'adaptation.monitor.calibration_windows': 1,
                  'adaptation.consolidation.steps': 3, 'adaptation.consolidation.batch_size': 4,
                  'adaptation.reflex.gate_threshold': -1.0}


@pytest.fixture(scope='module')
def vanilla_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('vanilla')
  train(_config(rollout__engine='vanilla'), workdir)
  return workdir


def _trained_with_trees(workdir, **overrides):
  """A specroll run whose gate verifies a tree on every step: prices saved as a resumed run
  finds them, a tree step below one plain step always pays (pricing: test_gate.py)."""
  workdir.mkdir()
  (workdir / STEP_COSTS_FILE).write_text(json.dumps([[16, 0.5]]))
  return train(_config(rollout__engine='specroll',
                       **{k.replace('.', '__'): v for k, v in overrides.items()}), workdir)


def _same_training(spec_dir, vanilla_dir):
  a, b = _metrics(spec_dir), _metrics(vanilla_dir)
  assert [m['rollout_digest'] for m in a] == [m['rollout_digest'] for m in b]
  assert [m['reward'] for m in a] == [m['reward'] for m in b]
  for x, y in zip(_final_params(spec_dir), _final_params(vanilla_dir)):
    # Identical tokens and pi_old from the learner (grpo.learner_old_logprobs): the updates
    # are the same computation, bit for bit.
    np.testing.assert_array_equal(x, y)
  return a


def test_specroll_and_vanilla_training_agree(tmp_path, vanilla_run):
  spec = _trained_with_trees(tmp_path / 'spec', **ALWAYS_TRIGGER)
  a = _same_training(tmp_path / 'spec', vanilla_run)
  assert spec['tau'] >= 1.0 and (tmp_path / 'spec' / 'report.md').exists()
  assert a[1]['triggered'], a[1]  # window 1 calibrates; window 2 consolidates
  assert all(max(m['reflex_gate']) > 0 for m in a)


def _slow_path_trains_the_block(tmp_path, vanilla_run, policy, kind: str, config_type,
                                **extra):
  """A run whose slow path trains the drafter of `kind` on every window after the first:
  the same training as vanilla's, the block changed and kept, its vocabulary not.
  Returns (overrides, metrics, the trained params)."""
  overrides = {**ALWAYS_TRIGGER, 'adaptation.mode': 'slow', 'rollout.proposers': kind,
               'adaptation.consolidation.rollback': True, **extra}
  spec = _trained_with_trees(tmp_path / 'spec', **overrides)
  a = _same_training(tmp_path / 'spec', vanilla_run)
  assert spec['tau'] >= 1.0 and a[1]['triggered'], a[1]
  assert len(a[1]['drafter_loss_before']) == config_type().depth
  _, warm = load_drafter(tmp_path / 'spec' / kind, policy.config, config_type)
  manager = ocp.CheckpointManager((tmp_path / 'spec' / 'checkpoints').resolve())
  trained = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore())['heads']
  kept = any(m.get('kept') for m in a)
  changed = [not np.array_equal(x, y) for x, y in zip(
      jax.tree.leaves(trained['params']['weights']), jax.tree.leaves(warm.weights))]
  assert kept and any(changed), [m.get('drafter_loss_after') for m in a]
  np.testing.assert_array_equal(trained['params']['vocab_ids'], warm.vocab_ids)
  return overrides, a, trained


def test_context_drafter_slow_path_trains_its_layer_and_changes_no_token(tmp_path,
                                                                         vanilla_run,
                                                                         stories_policy):
  _slow_path_trains_the_block(tmp_path, vanilla_run, stories_policy, 'context_drafter',
                              ContextDrafterConfig)


def test_a_drafter_reading_layer_features_trains_its_fusion_and_changes_no_token(
    tmp_path, vanilla_run, stories_policy):
  """Its warm start, rollouts and harvests carry layers 0 and 4 beside h_t; the slow path
  trains the fusion with the block."""
  _, _, trained = _slow_path_trains_the_block(tmp_path, vanilla_run, stories_policy, 'drafter',
                                              DrafterConfig,
                                              **{'drafter.model.feature_layers': (0, 4)})
  config, warm = load_drafter(tmp_path / 'spec' / 'drafter', stories_policy.config)
  assert config.feature_layers == (0, 4)
  fusion = zip(jax.tree.leaves(trained['params']['weights'][FEATURES]),
               jax.tree.leaves(warm.weights[FEATURES]))
  assert any(not np.array_equal(x, y) for x, y in fusion)


def test_drafter_slow_path_trains_its_block_and_changes_no_token(tmp_path, vanilla_run,
                                                                 stories_policy):
  overrides, a, trained = _slow_path_trains_the_block(tmp_path, vanilla_run, stories_policy,
                                                      'drafter', DrafterConfig)
  # Stopped after step 2 and resumed: the block, its Adam state and the monitor come back
  # from the checkpoint, and step 3 is the straight run's.
  _trained_with_trees(tmp_path / 'resumed', **overrides, steps=2)
  train(_config(rollout__engine='specroll', **{k.replace('.', '__'): v
                                               for k, v in overrides.items()}),
        tmp_path / 'resumed')
  strip = lambda rows: [{k: v for k, v in m.items() if not k.startswith(MEASURED)} for m in rows]
  assert strip(_metrics(tmp_path / 'resumed')) == strip(a)
  manager = ocp.CheckpointManager((tmp_path / 'resumed' / 'checkpoints').resolve())
  resumed = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore())['heads']
  for x, y in zip(jax.tree.leaves(resumed), jax.tree.leaves(trained)):
    np.testing.assert_array_equal(x, y)


# Kills land in the first phases of a step; each is checked to have landed where meant. A
# phase's kill comes within the first half of that phase's time in the uninterrupted run (a
# fixed delay outlasted a fast machine's rollout). The checkpoint kill waits for Orbax's
# temporary directory (the write has begun), then comes within the ~0.1 s the write takes.
KILLS = (('rollout', 2), ('update', 2), ('checkpoint', 3))
CHECKPOINT_KILL_DELAY = 0.02
PARTIAL_CHECKPOINT = '*.orbax-checkpoint-tmp*'
# Keys whose values are measurements of this run, not results of its computation.
MEASURED = ('time_', 'tail_decode_share', 'rss_mib', 'live_array', 'compilations')


def _command(workdir):
  overrides = {**SMALL, **ALWAYS_TRIGGER, 'steps': 4, 'rollout.engine': 'specroll'}
  return [sys.executable, '-m', 'experiments.train_grpo', f'--workdir={workdir}',
          *[f'--config.{k}={v}' for k, v in overrides.items()]]


def _partial_checkpoints(workdir):
  return list((workdir / 'checkpoints').glob(PARTIAL_CHECKPOINT))


MARKER = re.compile(r'step (\d+): (\w[\w ]*)$')


def _read_markers(stream, markers: queue.Queue):
  """Puts each (step, phase) the run logs into `markers`, then None when the log ends."""
  for line in stream:
    if found := MARKER.search(line.strip()):
      markers.put((int(found[1]), found[2]))
  markers.put(None)


def _kill_in_phase(workdir, phase, step, max_delay, rng):
  """Runs the job until it logs `step N: phase` for some N >= `step` (for a checkpoint:
  and its write has begun), then SIGKILLs it after a random delay; returns (the last phase
  it logged, N). Where the run logs its next phase during the delay (a phase can run faster
  here than in the straight run the delay came from, as the machine's load moves), that
  kill is called off and the next step's phase is tried. A marker the run has written but
  the reader thread has not yet queued when the delay ends is still missed: the test then
  fails on the phase the kill landed in, never silently."""
  process = subprocess.Popen(_command(workdir), cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
  markers = queue.Queue()
  threading.Thread(target=_read_markers, args=(process.stderr, markers), daemon=True).start()
  seen, kill_at, killed_step, ended = [], None, None, False
  while True:
    try:
      marker = markers.get(timeout=None if kill_at is None else max(0.0, kill_at - time.time()))
    except queue.Empty:  # the delay ended inside the phase
      process.send_signal(signal.SIGKILL)
      break
    if ended := marker is None:
      break
    seen.append(marker)
    # Orbax writes asynchronously: a checkpoint write outlives its phase's marker.
    if kill_at is not None and phase != 'checkpoint':
      kill_at = None
    if kill_at is None and marker[1] == phase and marker[0] >= step:
      deadline = time.time() + 30
      while phase == 'checkpoint' and not _partial_checkpoints(workdir) and (
          time.time() < deadline):
        time.sleep(0.001)
      kill_at, killed_step = time.time() + rng.uniform(0.0, max_delay), marker[0]
  if not ended:  # what the run logged before the kill stopped it
    seen += list(iter(markers.get, None))
  process.wait()
  assert process.returncode == -signal.SIGKILL, (
      f'{phase}: the run ended before the kill; it logged {seen}')
  return seen[-1], killed_step


def _checkpoint(workdir):
  manager = ocp.CheckpointManager((workdir / 'checkpoints').resolve())
  return manager.restore(manager.latest_step(), args=ocp.args.StandardRestore())


@pytest.mark.slow
def test_run_killed_in_each_phase_resumes_to_the_same_state(tmp_path):
  # Every launch loads the session's compiled programs (conftest's cache) instead of
  # compiling them again: the same executables, so the same bits.
  rng = random.Random(0)
  straight, killed = tmp_path / 'straight', tmp_path / 'killed'
  for workdir in (straight, killed):
    workdir.mkdir()
    # Prices saved as a resumed run finds them (pricing is timed, so it would differ).
    (workdir / STEP_COSTS_FILE).write_text(json.dumps([[16, 0.5]]))
  subprocess.run(_command(straight), cwd=REPO, check=True, capture_output=True)
  timed = {m['step']: m for m in _metrics(straight)}
  for phase, step in KILLS:
    # Half the phase's shortest time from this step on in the straight run: a step that
    # compiled a program (the harvesting update, first run on step 2) took longer there
    # than the killed run, which loads it from the session's cache, takes.
    max_delay = (CHECKPOINT_KILL_DELAY if phase == 'checkpoint'
                 else min(m[f'time_{phase}'] for s, m in timed.items() if s >= step) / 2)
    landed, killed_step = _kill_in_phase(killed, phase, step, max_delay, rng)
    if phase == 'checkpoint':
      # Orbax writes asynchronously: the write goes on into the next step's first phase
      # (a tiny model's can be that quick), and what the kill must interrupt is the write.
      assert landed[0] in (killed_step, killed_step + 1), landed
      assert list((killed / 'checkpoints').glob(f'{killed_step}{PARTIAL_CHECKPOINT}')), (
          'the kill missed the checkpoint write')
    else:
      assert landed == (killed_step, phase), landed
  subprocess.run(_command(killed), cwd=REPO, check=True, capture_output=True)
  drop = lambda rows: [{k: v for k, v in r.items() if not k.startswith(MEASURED)} for r in rows]
  assert drop(_metrics(killed)) == drop(_metrics(straight))
  a, b = _checkpoint(killed), _checkpoint(straight)
  assert int(a['step']) == int(b['step']) == 4
  # Policy, optimizer state, heads and the slow path's monitor, bit for bit.
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


def test_metrics_cut_short_by_a_kill_are_dropped_on_resume(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"ste')
  truncate_metrics(path, last_step=2)
  assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


def _scalar_events(workdir):
  return [(e.step, v.tag, v.simple_value)
          for f in sorted((workdir / EVENTS_DIR).iterdir()) for e in read_events(f)
          for v in e.summary.value]


def test_tensorboard_events_hold_the_metrics_scalars(vanilla_run):
  expected = [(m['step'], tag, np.float32(value)) for m in _metrics(vanilla_run)
              for tag, value in scalars(m).items()]
  assert ('reward' in {tag for _, tag, _ in expected}
          and sorted(_scalar_events(vanilla_run)) == sorted(expected))


def test_a_resumed_log_purges_the_steps_after_its_checkpoint(tmp_path):
  first = MetricsLog(tmp_path / 'metrics.jsonl', 0, primary=True)
  for step in (1, 2, 3):
    first.append({'step': step, 'reward': 0.5})
  first.close()
  MetricsLog(tmp_path / 'metrics.jsonl', 2, primary=True).close()
  resumed = read_events(sorted((tmp_path / EVENTS_DIR).iterdir())[-1])
  # TensorBoard drops the earlier files' events from this step on.
  assert [e.step for e in resumed if e.HasField('session_log')] == [3]


def test_config_pointing_at_a_missing_checkpoint_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match='policy.checkpoint: .*nowhere does not exist'):
    train(_config(policy__checkpoint=str(tmp_path / 'nowhere')), tmp_path / 'run')


def test_prompt_longer_than_the_model_allows_is_a_clear_error(tmp_path):
  with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
    train(_config(rollout__engine='vanilla', rollout__driver__max_new_tokens=480), tmp_path / 'run')


def test_held_out_evaluation_is_scheduled_and_never_feeds_the_learner(tmp_path):
  plain = {'steps': 3, 'rollout__engine': 'vanilla'}
  train(_config(**plain), tmp_path / 'plain')
  train(_config(**plain, evaluation__every=2, evaluation__count=4, evaluation__samples=2),
        tmp_path / 'evaluated')
  a, b = _metrics(tmp_path / 'plain'), _metrics(tmp_path / 'evaluated')
  # The policies each step starts from after 0 and 2 updates: steps 1 and 3.
  assert [m.get('heldout_updates') for m in b] == [0, None, 2]
  assert all(0.0 <= m['heldout_accuracy'] <= m['heldout_reward'] <= 1.0 for m in b[::2])
  assert [m['rollout_digest'] for m in a] == [m['rollout_digest'] for m in b]
  for x, y in zip(_final_params(tmp_path / 'plain'), _final_params(tmp_path / 'evaluated')):
    np.testing.assert_array_equal(x, y)


def test_real_model_job_runs_its_code_path_on_a_tiny_model(tmp_path):
  # configs/smol_grpo.py as it runs on SmolLM2 (GSM8K chat prompts, format reward, group
  # drafts, held-out GSM8K test questions), with stories260K and the fixture GSM8K instead.
  c = smol_grpo.get_config()
  for key, value in {**SMALL, 'steps': 2, 'task.data_dir': str(FIXTURE_DATA),
                     'task.chat_template': False, 'evaluation.every': 1,
                     'evaluation.count': 2}.items():
    *path, leaf = key.split('.')
    node = c
    for part in path:
      node = node[part]
    node[leaf] = value
  (tmp_path / STEP_COSTS_FILE).write_text(json.dumps([[16, 0.5]]))
  train(c, tmp_path)
  rows = _metrics(tmp_path)
  assert [m['heldout_updates'] for m in rows] == [0, 1]
  assert all(f'heldout_{rule}' in rows[0] for rule in REWARD_RULES)
  assert all(m['tree_step_share'] > 0 for m in rows)  # group drafts verified in trees
