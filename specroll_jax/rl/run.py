"""A GRPO run built once from its config: everything the steps read and never change.

`check_config` runs first and loads nothing, so a bad section fails in seconds. Every
process of a multi-process run builds the same run from the same config and workdir (a
shared filesystem): process 0 writes metrics, the report and cached files; Orbax writes the
checkpoints from every process.
"""
import dataclasses
import sys
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from specroll_jax.adapt.consolidation import ConsolidationConfig
from specroll_jax.adapt.monitor import MonitorConfig
from specroll_jax.adapt.reflex import ReflexConfig
from specroll_jax.model.mesh import AXES, ROWS, MeshConfig, axis_size, make_mesh
from specroll_jax.model.policy import Policy, load_policy
from specroll_jax.rl import distributed, memory
from specroll_jax.rl.audit import Audit, AuditConfig
from specroll_jax.rl.evaluation import EvaluationConfig, HeldOutEvaluation, held_out_tasks
from specroll_jax.rl.drafter_adaptation import (DrafterAdaptation, drafter_branching,
                                                drafter_training, warm_start_run_drafter)
from specroll_jax.rl.head_adaptation import (ADAPTATION_MODES, Adaptation, HeadAdaptation,
                                             warm_start_heads)
from specroll_jax.rl.learner import Learner, TrainState, grpo_config
from specroll_jax.rl.metrics import METRICS_FILE, MetricsLog
from specroll_jax.rl.resources import return_large_frees_to_the_os
from specroll_jax.rl.rollouts import (Rollouts, check_tree_section, driver_config,
                                      head_draft_config, run_prompt_width, sampler_config)
from specroll_jax.rl.sections import build
from specroll_jax.speculative.factory import ENGINES, learned_proposer, parse_proposers
from specroll_jax.speculative.gate import GateConfig
from specroll_jax.speculative.group_proposer import GroupDraftConfig
from specroll_jax.tasks.default_policy import ensure_default_policy
from specroll_jax.tasks.rewards import REWARD_RULES
from specroll_jax.tasks.sources import load_tasks

STEP_COSTS_FILE = 'step_costs.json'  # the speculation gate's prices, measured on the first batch


def check_config(c) -> None:
  """Every section builds its dataclass and names are valid, before anything is loaded."""
  if c.rollout.engine not in ENGINES:
    raise ValueError(f'config rollout.engine must be one of {ENGINES}, got {c.rollout.engine!r}')
  if c.adaptation.mode not in ADAPTATION_MODES:
    raise ValueError(f'config adaptation.mode must be one of {ADAPTATION_MODES}, '
                     f'got {c.adaptation.mode!r}')
  build(ReflexConfig, c.adaptation.reflex, 'adaptation.reflex')
  build(MonitorConfig, c.adaptation.monitor, 'adaptation.monitor')
  build(ConsolidationConfig, c.adaptation.consolidation, 'adaptation.consolidation')
  build(ConsolidationConfig, c.adaptation.online, 'adaptation.online')
  grpo_config(c, c.adaptation.harvest_top_k)
  sampler_config(c)
  driver = driver_config(c, prompt_width=16)
  check_tree_section(c)
  head_draft_config(c)
  learned = learned_proposer(parse_proposers(c.rollout.proposers))
  if learned is None and c.adaptation.mode != 'static':
    raise ValueError(f'config adaptation.mode={c.adaptation.mode!r} adapts heads or a drafter, '
                     f'but rollout.proposers={c.rollout.proposers!r} has neither (use '
                     'mode=static)')
  if learned == 'drafter':
    if c.adaptation.mode in ('reflex', 'both'):
      raise ValueError(f'config adaptation.mode={c.adaptation.mode!r}: Reflex corrects horizon '
                       'heads and does not apply to the drafter (speculative/'
                       'drafter_proposer.py); use static, slow or online')
    drafter_training(c)
    drafter_branching(c)
  build(GroupDraftConfig, c.rollout.group, 'rollout.group')
  build(GateConfig, c.rollout.gate, 'rollout.gate')
  build(AuditConfig, c.audit, 'audit')
  build(EvaluationConfig, c.evaluation, 'evaluation')
  if c.task.reward not in REWARD_RULES:
    raise ValueError(f'config task.reward must be one of {REWARD_RULES}, got {c.task.reward!r}')
  mesh = build(MeshConfig, c.mesh, 'mesh')
  rows_split = axis_size(dict(zip(AXES, mesh.shape(jax.device_count()))), ROWS)
  for name, value in (('rollout.driver.max_batch', driver.max_batch),
                      ('grpo.micro_batch_size', c.grpo.micro_batch_size)):
    if value % rows_split:
      raise ValueError(f'config {name}={value} must be a multiple of mesh data x fsdp = '
                       f'{rows_split} (rows are split over both)')
  if c.rollout.prompts_per_step % jax.process_count():
    raise ValueError(f'config rollout.prompts_per_step={c.rollout.prompts_per_step} must be '
                     f'a multiple of the {jax.process_count()} processes (each scores its share)')


def resolve_policy(c) -> Path:
  if c.policy.checkpoint:
    path = Path(c.policy.checkpoint)
    if not path.is_dir():
      raise FileNotFoundError(f'config policy.checkpoint: {path} does not exist')
    return path
  return ensure_default_policy(c.policy.cache_dir)


@dataclasses.dataclass(frozen=True)
class Run:
  config: Any                 # the checked ml_collections config
  workdir: Path
  primary: bool               # process 0: writes metrics, the report and cached files
  policy: Policy
  tasks: list                 # the task list the steps cycle through
  task_prompts: list          # their prompt token ids, encoded once
  rollouts: Rollouts
  audit: Audit
  evaluation: HeldOutEvaluation      # held-out prompts, never trained on
  adaptation: Adaptation | None      # of the heads or the drafter; None when neither drafts
  learner: Learner
  checkpoints: ocp.CheckpointManager
  metrics: MetricsLog

  def step_tasks(self, position: int):
    """The next step's tasks and prompt ids, from `position` in the cycled task list."""
    indices = [(position + i) % len(self.tasks)
               for i in range(self.config.rollout.prompts_per_step)]
    return [self.tasks[i] for i in indices], [self.task_prompts[i] for i in indices]

  def next_position(self, position: int) -> int:
    return (position + self.config.rollout.prompts_per_step) % len(self.tasks)


def make_run(c, workdir) -> tuple[Run, TrainState]:
  """The run of config `c` in `workdir`, and the state it starts from: step 0, or the latest
  checkpoint there."""
  check_config(c)
  if c.return_large_frees:
    return_large_frees_to_the_os()
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  primary = distributed.is_primary()
  policy_dir = distributed.primary_first('policy', lambda: resolve_policy(c))
  policy = load_policy(policy_dir, dtype=c.policy.dtype,
                       compute_dtype=c.policy.compute_dtype)
  tasks = load_tasks(c.task.source, count=c.task.count, seed=c.seed,
                     data_dir=c.task.data_dir or None, split=c.task.split or None,
                     chat=c.task.chat_template)
  if not tasks:
    raise ValueError(f'config task.source={c.task.source!r} yielded no prompts')
  # Encoded once: rollouts, the learner's width and warm-start data all use these ids.
  task_prompts = [policy.prompt_ids(t.prompt, c.task.chat_template) for t in tasks]
  heads_dir = heads_config = heads = drafter = None
  learned = (learned_proposer(parse_proposers(c.rollout.proposers))
             if c.rollout.engine == 'specroll' else None)
  if learned == 'heads':
    heads_config, heads, heads_dir = distributed.primary_first(
        'heads', lambda: warm_start_heads(policy, c, task_prompts, workdir, policy_dir))
  elif learned == 'drafter':
    drafter, heads = distributed.primary_first(
        'drafter', lambda: warm_start_run_drafter(policy, c, task_prompts, workdir, policy_dir))
  mesh = make_mesh(build(MeshConfig, c.mesh, 'mesh'))
  evaluation_config = build(EvaluationConfig, c.evaluation, 'evaluation')
  held_out = held_out_tasks(evaluation_config, c, tasks) if evaluation_config.every else []
  held_out_prompts = [policy.prompt_ids(t.prompt, c.task.chat_template) for t in held_out]
  prompt_width = run_prompt_width(task_prompts + held_out_prompts)
  width = prompt_width + c.rollout.driver.max_new_tokens
  report = memory.report(policy.config,
                         memory.Workload.from_config(c, width, heads_config, drafter),
                         dict(mesh.shape))
  if primary:
    print(report.table(), file=sys.stderr)
  rollouts = Rollouts(policy, c, heads_config, heads_dir, prompt_width, mesh,
                      workdir / STEP_COSTS_FILE, drafter)
  audit = Audit(policy, build(AuditConfig, c.audit, 'audit'), sampler_config(c),
                rollouts.driver.config, c.rollout.group_size, mesh)
  evaluation = HeldOutEvaluation(evaluation_config, policy, held_out, held_out_prompts,
                                 sampler_config(c), rollouts.driver.config, c.task.reward, mesh)
  adaptation = None
  if learned == 'heads':
    adaptation = HeadAdaptation(c, policy, heads_config, head_draft_config(c).branching,
                                rollouts.proposer)
  elif learned == 'drafter':
    adaptation = DrafterAdaptation(c, policy, drafter, rollouts.proposer)
  learner = Learner(c, policy, width, mesh)
  state = learner.init_state(None if adaptation is None else adaptation.init_state(heads, mesh))
  checkpoints = ocp.CheckpointManager(
      (workdir / 'checkpoints').resolve(),
      options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=1))
  if checkpoints.latest_step() is not None:
    state = checkpoints.restore(checkpoints.latest_step(), args=ocp.args.StandardRestore(state))
    if primary:
      print(f'resumed from step {int(state.step)}', file=sys.stderr)
  run = Run(config=c, workdir=workdir, primary=primary, policy=policy, tasks=tasks,
            task_prompts=task_prompts, rollouts=rollouts, audit=audit, evaluation=evaluation,
            adaptation=adaptation,
            learner=learner, checkpoints=checkpoints,
            metrics=MetricsLog(workdir / METRICS_FILE, int(state.step), primary))
  return run, state
