"""The GRPO training loop: rollout (vanilla or SpecRoll) -> rewards -> GRPO update.

`train` builds the run once (rl/run.py) and calls `step` until the configured number of
steps; `step` reads top to bottom as the phases of one GRPO step. The per-step rollout seed
is `step_seed(c, step)`, so a run resumed from its checkpoint draws exactly what the
uninterrupted one would have.
"""
import sys

import numpy as np
import orbax.checkpoint as ocp
from tqdm import tqdm

from specroll_jax.rl.learner import TrainState
from specroll_jax.rl.metrics import step_metrics
from specroll_jax.rl.phases import PhaseTimer
from specroll_jax.rl.report import write_report
from specroll_jax.rl.rollouts import step_seed
from specroll_jax.rl.run import Run, make_run
from specroll_jax.rl.run_config import run_config
from specroll_jax.rl.schedule import due
from specroll_jax.rl.scoring import scored


def train(c, workdir) -> dict:
  """Runs (or resumes) GRPO per the ml_collections config `c` (configs/tiny_math.py's
  shape) in `workdir`; returns the last step's metrics."""
  c = run_config(c)
  run, state = make_run(c, workdir)
  metrics = {}
  with tqdm(total=c.steps, initial=int(state.step), desc='grpo', file=sys.stderr,
            disable=not run.primary) as bar:
    while int(state.step) < c.steps:
      state, metrics = step(run, state)
      bar.update(1)
      bar.set_postfix(reward=f"{metrics['reward']:.2f}", tau=f"{metrics['tau']:.2f}")
  finish(run)
  return metrics


def finish(run: Run) -> None:
  """Waits for the last checkpoint's write, closes the metrics and writes report.md."""
  c = run.config
  run.checkpoints.wait_until_finished()
  run.metrics.close()
  if run.primary:
    # Whole passes over the task list, so both windows hold the same prompts when it cycles.
    steps_per_pass = -(-len(run.tasks) // c.rollout.prompts_per_step)
    write_report(run.workdir, window=max(1, min(steps_per_pass, c.steps // 4)),
                 reward_rule=c.task.reward)


def step(run: Run, state: TrainState) -> tuple[TrainState, dict]:
  """One GRPO step, phase by phase; returns the next state and the step's metrics line."""
  c, number, checks = run.config, int(state.step) + 1, {}
  seed, timer = step_seed(c, int(state.step)), PhaseTimer(number)
  tasks, prompts = run.step_tasks(int(state.data_position))
  policy_params = run.learner.rollout_params(state)
  if run.evaluation.due(int(state.step)):
    with timer('evaluation'):
      checks.update(run.evaluation(policy_params, int(state.step)))
  segments = []
  with timer('rollout'):
    responses = run.rollouts.generate(policy_params, state.heads, prompts, seed, segments)
  if run.audit.due(number):
    with timer('audit'):
      checks.update(run.audit(policy_params, prompts, seed, responses, timer.seconds['rollout']))
  with timer('reward'):
    scores = scored(c.task.reward, tasks, responses, run.policy.tokenizer)
  with timer('logprobs'):
    batch = run.learner.batch(prompts, responses, scores)
  proposer, triggered, proposer_metrics = state.heads, np.zeros(0, bool), {}
  with timer('proposer_update'):
    if run.adaptation is not None:
      proposer, triggered, proposer_metrics = run.adaptation.observe(proposer, responses)
  with timer('update'):
    updated, update, pairs = run.learner.update(state, batch, harvest=triggered.any())
  if triggered.any():
    with timer('proposer_update'):
      proposer, consolidated = run.adaptation.consolidate(
          proposer, triggered, policy_params, pairs, [r.prompt_index for r in responses], seed)
    proposer_metrics.update(consolidated)
  if due(c.metrics.drift_kl_every, number):
    proposer_metrics['drift_kl'] = run.learner.drift_kl(batch)
  state = updated.replace(step=number, heads=proposer,
                          data_position=run.next_position(int(state.data_position)))
  metrics = step_metrics(number, scores, responses, run.rollouts.engine.summarize(responses),
                         segments, update, proposer_metrics, checks, timer)
  run.metrics.append(metrics)
  if due(c.checkpoint_every, number) or number == c.steps:
    with timer('checkpoint'):
      run.checkpoints.save(number, args=ocp.args.StandardSave(state))
  return state, metrics
