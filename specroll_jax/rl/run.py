"""A GRPO run built once from its config: everything the steps read and never change.

The config arrives typed and checked (rl/run_config.py: a bad field fails in seconds). Every
process of a multi-process run builds the same run from the same config and workdir (a
shared filesystem): process 0 writes metrics, the report and cached files; Orbax writes the
checkpoints from every process.
"""
import dataclasses
import sys
from pathlib import Path

import orbax.checkpoint as ocp

from specroll_jax.model.mesh import make_mesh
from specroll_jax.model.policy import Policy, load_policy
from specroll_jax.rl import distributed, memory
from specroll_jax.rl.audit import Audit
from specroll_jax.rl.evaluation import HeldOutEvaluation, held_out_tasks
from specroll_jax.rl.adaptation import Adaptation
from specroll_jax.rl.learned_proposers import KINDS
from specroll_jax.rl.learner import Learner, TrainState
from specroll_jax.rl.metrics import METRICS_FILE, MetricsLog
from specroll_jax.rl.resources import return_large_frees_to_the_os
from specroll_jax.rl.rollouts import Rollouts, make_proposer, run_prompt_width
from specroll_jax.rl.run_config import PolicySection, RunConfig
from specroll_jax.tasks.default_policy import ensure_default_policy
from specroll_jax.tasks.sources import load_tasks

STEP_COSTS_FILE = 'step_costs.json'  # the speculation gate's prices, measured on the first batch


def resolve_policy(policy: PolicySection) -> Path:
  """The policy's directory: policy.checkpoint, or the committed W1 policy's build."""
  if policy.checkpoint:
    path = Path(policy.checkpoint)
    if not path.is_dir():
      raise FileNotFoundError(f'config policy.checkpoint: {path} does not exist')
    return path
  return ensure_default_policy(policy.cache_dir)


def step_indices(position: int, prompts_per_step: int, count: int) -> list[int]:
  """The task indices of the step that starts at `position` in the cycled task list."""
  return [(position + i) % count for i in range(prompts_per_step)]


@dataclasses.dataclass(frozen=True)
class Run:
  config: RunConfig
  workdir: Path
  primary: bool               # process 0: writes metrics, the report and cached files
  policy: Policy
  tasks: list                 # the task list the steps cycle through
  task_prompts: list          # their prompt token ids, encoded once
  rollouts: Rollouts
  audit: Audit
  evaluation: HeldOutEvaluation      # held-out prompts, never trained on
  adaptation: Adaptation | None      # of the learned proposer; None when none drafts
  learner: Learner
  checkpoints: ocp.CheckpointManager
  metrics: MetricsLog

  def step_tasks(self, position: int):
    """The next step's tasks and prompt ids, from `position` in the cycled task list."""
    indices = step_indices(position, self.config.rollout.prompts_per_step, len(self.tasks))
    return [self.tasks[i] for i in indices], [self.task_prompts[i] for i in indices]

  def next_position(self, position: int) -> int:
    return (position + self.config.rollout.prompts_per_step) % len(self.tasks)


def make_run(c: RunConfig, workdir) -> tuple[Run, TrainState]:
  """The run of config `c` in `workdir`, and the state it starts from: step 0, or the latest
  checkpoint there."""
  if c.return_large_frees:
    return_large_frees_to_the_os()
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  primary = distributed.is_primary()
  policy_dir = distributed.primary_first('policy', lambda: resolve_policy(c.policy))
  policy = load_policy(policy_dir, dtype=c.policy.dtype,
                       compute_dtype=c.policy.compute_dtype)
  tasks = load_tasks(c.task.source, count=c.task.count, seed=c.seed,
                     data_dir=c.task.data_dir or None, split=c.task.split or None,
                     chat=c.task.chat_template)
  if not tasks:
    raise ValueError(f'config task.source={c.task.source!r} yielded no prompts')
  # Encoded once: rollouts, the learner's width and warm-start data all use these ids.
  task_prompts = [policy.prompt_ids(t.prompt, c.task.chat_template) for t in tasks]
  learned = c.rollout.learned_proposer
  kind = KINDS[learned] if learned else None
  warm = None if kind is None else distributed.primary_first(
      learned, lambda: kind.warm_start(policy, c, task_prompts, workdir, policy_dir))
  mesh = make_mesh(c.mesh)
  held_out = []
  if c.evaluation.every:
    held_out = held_out_tasks(c.evaluation, tasks, task_source=c.task.source,
                              data_dir=c.task.data_dir, chat_template=c.task.chat_template)
  held_out_prompts = [policy.prompt_ids(t.prompt, c.task.chat_template) for t in held_out]
  prompt_width = run_prompt_width(task_prompts + held_out_prompts)
  width = prompt_width + c.rollout.driver.max_new_tokens
  report = memory.report(policy.config,
                         memory.Workload.from_config(
                             c, width, kind and kind.memory(policy.config, warm.config)),
                         dict(mesh.shape))
  if primary:
    print(report.table(), file=sys.stderr)
  proposer = make_proposer(policy, c, warm)
  adaptation = None if kind is None else kind.adaptation(policy, c, warm, proposer)
  learner = Learner(c.grpo, policy, width, mesh, harvest_top_k=c.adaptation.harvest_top_k,
                    harvest_feature_layers=proposer.feature_layers if proposer else (),
                    drift_kl_every=c.metrics.drift_kl_every, seed=c.seed)
  checkpoints, state = _latest_state(workdir, learner, adaptation, warm, mesh, primary)
  first = step_indices(int(state.data_position), c.rollout.prompts_per_step, len(tasks))
  rollouts = Rollouts(policy, c.rollout, proposer, prompt_width, mesh, workdir / STEP_COSTS_FILE,
                      first_batch=(learner.rollout_params(state), state.heads,
                                   [task_prompts[i] for i in first]))
  audit = Audit(policy, c.audit, c.rollout.sampler, rollouts.driver.config,
                c.rollout.group_size, mesh)
  evaluation = HeldOutEvaluation(c.evaluation, policy, held_out, held_out_prompts,
                                 c.rollout.sampler, rollouts.driver.config, c.task.reward, mesh)
  run = Run(config=c, workdir=workdir, primary=primary, policy=policy, tasks=tasks,
            task_prompts=task_prompts, rollouts=rollouts, audit=audit, evaluation=evaluation,
            adaptation=adaptation,
            learner=learner, checkpoints=checkpoints,
            metrics=MetricsLog(workdir / METRICS_FILE, int(state.step), primary))
  return run, state


def _latest_state(workdir: Path, learner: Learner, adaptation: Adaptation | None, warm, mesh,
                  primary: bool) -> tuple[ocp.CheckpointManager, TrainState]:
  """The run's checkpoint manager, and the state it starts from: step 0, or the latest
  checkpoint in `workdir`."""
  state = learner.init_state(None if adaptation is None
                             else adaptation.init_state(warm.params, mesh))
  checkpoints = ocp.CheckpointManager(
      (workdir / 'checkpoints').resolve(),
      options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=1))
  if checkpoints.latest_step() is not None:
    state = checkpoints.restore(checkpoints.latest_step(), args=ocp.args.StandardRestore(state))
    if primary:
      print(f'resumed from step {int(state.step)}', file=sys.stderr)
  return checkpoints, state
