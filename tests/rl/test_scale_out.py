"""GRPO on one (data, fsdp, tensor) mesh equals GRPO on one device; two processes
(jax.distributed over gloo, 4 host devices each), killed together mid-run and relaunched,
equal one process with 8; LoRA's first rollout is the base policy's."""
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import traverse_util

from specroll_jax import load_policy
from specroll_jax.rl.run import STEP_COSTS_FILE
from specroll_jax.rl.trainer import train
from specroll_jax.tasks.default_policy import ensure_default_policy
from tests.conftest import REPO
from tests.rl.test_trainer import SMALL, _config, _metrics

# The committed W1 policy answers some of these tasks, so advantages (and gradients) are
# not zero; a small learning rate keeps step 2's rollout on the tokens of step 1's params.
SCALE = {'policy.checkpoint': '', 'rollout.driver.max_new_tokens': 40, 'steps': 2,
         'grpo.learning_rate': 1e-4, 'grpo.weight_decay': 0.0}
SHARDED = {'mesh.data': 1, 'mesh.fsdp': 4, 'mesh.tensor': 2}


def _run(workdir, **overrides):
  workdir.mkdir()
  # Prices saved as a resumed run finds them: every step verifies a tree.
  (workdir / STEP_COSTS_FILE).write_text('[[16, 0.5]]')
  return train(_config(**{k.replace('.', '__'): v for k, v in {**SCALE, **overrides}.items()}),
               workdir)


def _restored(workdir):
  """The latest checkpoint on this process's first device, whatever topology wrote it."""
  step = ocp.CheckpointManager((workdir / 'checkpoints').resolve()).latest_step()
  directory = (workdir / 'checkpoints' / str(step) / 'default').resolve()
  checkpointer = ocp.StandardCheckpointer()
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                        checkpointer.metadata(directory).item_metadata)
  return checkpointer.restore(directory, target)


def _close(sharded, single, learning_rate, steps):
  """Policies after `steps` AdamW steps on identical tokens: all but a few entries agree to
  1e-6; entries whose gradient sits within a few eps of zero can differ up to Adam's bound
  of lr per step on each side (tests/rl/test_mesh_learner.py derives both)."""
  for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single), strict=True):
    difference = np.abs(np.asarray(a) - np.asarray(b))
    assert difference.max() <= 2 * steps * learning_rate
    assert np.mean(difference <= 1e-6) >= 0.999


def _same_results(a, b):
  """Tokens and rewards exactly; losses to float32 rounding of a sharded sum (1e-5, as in
  test_mesh_learner) widened to 1e-4 for step 2, whose parameters already differ within
  _close's bounds, plus 1e-7 absolute: at ratio 1 the loss is a sum of zero-mean
  advantages that mostly cancel (~1e-3 here, from terms of ~1 / 1e3 tokens), so its
  rounding follows the terms, not the small sum."""
  assert [m['rollout_digest'] for m in a] == [m['rollout_digest'] for m in b]
  assert [m['reward'] for m in a] == [m['reward'] for m in b]
  np.testing.assert_allclose([m['loss'] for m in a], [m['loss'] for m in b], rtol=1e-4,
                             atol=1e-7)


def test_fsdp_tensor_mesh_equals_one_device_and_lora_starts_at_the_base(tmp_path):
  # Speculative rollouts on the mesh against vanilla on one device: the engines emit the
  # same tokens and the learner's update does not depend on the engine (test_trainer), so
  # this compares the mesh with one device, and vanilla compiles in a third of the time.
  _run(tmp_path / 'one', **{'rollout.engine': 'vanilla'})
  _run(tmp_path / 'sharded', **SHARDED)
  one, sharded = _metrics(tmp_path / 'one'), _metrics(tmp_path / 'sharded')
  assert any(m['reward'] > 0 for m in one)
  _same_results(sharded, one)
  _close(_restored(tmp_path / 'sharded')['policy'], _restored(tmp_path / 'one')['policy'],
         1e-4, 2)
  _run(tmp_path / 'lora', **SHARDED, **{'grpo.lora_rank': 4, 'rollout.engine': 'vanilla'})
  adapted = _metrics(tmp_path / 'lora')
  # B = 0: the first rollout is the base policy's, token for token.
  assert adapted[0]['rollout_digest'] == one[0]['rollout_digest']
  restored = _restored(tmp_path / 'lora')
  base = load_policy(ensure_default_policy('workdir/policies')).params
  for x, y in zip(jax.tree.leaves(restored['policy']), jax.tree.leaves(base), strict=True):
    np.testing.assert_array_equal(x, y)  # only the adapters are trained
  flat = traverse_util.flatten_dict(restored['adapters'], sep='/')
  assert all(np.abs(v).max() > 0 for p, v in flat.items() if p.endswith('lora_b'))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _processes(workdir, kill_at=None):
  """Runs the job as 2 processes of 4 host devices each; with kill_at=(step, phase),
  SIGKILLs both once process 0 logs it. Returns the processes' return codes.

  Each process logs to a file: a pipe nobody drains fills up, and a process blocked on
  its stderr stalls the other in their next collective.
  """
  port = _free_port()
  # The session's compilation cache (conftest): the relaunch loads what the first launch
  # compiled.
  env = {**os.environ, 'XLA_FLAGS': '--xla_force_host_platform_device_count=4'}
  overrides = {**SMALL, **SCALE, **MULTI_PROCESS}
  logs = [workdir.with_name(f'{workdir.name}_process_{i}.log') for i in range(2)]
  processes = []
  for i, log in enumerate(logs):
    with log.open('w') as stream:
      processes.append(subprocess.Popen(
          [sys.executable, '-m', 'experiments.train_grpo', f'--workdir={workdir}',
           f'--coordinator_address=127.0.0.1:{port}', '--num_processes=2', f'--process_id={i}',
           *[f'--config.{k}={v}' for k, v in overrides.items()]],
          cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=stream))
  try:
    if kill_at is not None:
      marker = re.compile(rf'step {kill_at[0]}: {kill_at[1]}$', re.MULTILINE)
      deadline = time.time() + 600
      while not marker.search(logs[0].read_text()) and time.time() < deadline:
        assert processes[0].poll() is None, 'process 0 ended before the kill'
        time.sleep(0.05)
      for p in processes:
        p.send_signal(signal.SIGKILL)
    for p in processes:
      p.wait(timeout=600)
  finally:
    for p in processes:
      if p.poll() is None:
        p.kill()
  codes = [p.returncode for p in processes]
  if kill_at is None:
    assert codes == [0, 0], ''.join(log.read_text()[-3000:] for log in logs)
  return codes


# The processes run vanilla rollouts: what crosses processes (global arrays, gathered
# decisions, the sharded update, Orbax's multi-host checkpoints) is the same for either
# engine, and the speculative engine on this mesh is the first test's; vanilla keeps the
# two two-process launches to ~35 s each.
MULTI_PROCESS = {**SHARDED, 'rollout.engine': 'vanilla'}


@pytest.mark.slow
def test_two_processes_killed_and_resumed_equal_one_process(tmp_path):
  _run(tmp_path / 'one_process', **MULTI_PROCESS)
  killed = tmp_path / 'two'
  killed.mkdir()
  assert _processes(killed, kill_at=(2, 'update')) == [-signal.SIGKILL] * 2
  # Step 1's checkpoint is complete, so the relaunch resumes rather than starts over.
  assert ocp.CheckpointManager((killed / 'checkpoints').resolve()).latest_step() == 1
  _processes(killed)
  _same_results(_metrics(killed), _metrics(tmp_path / 'one_process'))
  _close(_restored(killed)['policy'], _restored(tmp_path / 'one_process')['policy'], 1e-4, 2)
