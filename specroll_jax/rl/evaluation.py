"""Held-out evaluation during GRPO: fixed prompts the run never trains on, sampled with the
run's sampler and scored with its reward rule, every `evaluation.every` updates.

It reads the policy and nothing else: its rollouts run on the vanilla engine (the tokens
SpecRoll would emit, without touching the heads' adaptation or the gate), with a seed of its
own that is the same at every evaluation, so two evaluations differ only by the policy.
"""
import dataclasses

import numpy as np

from specroll_jax.model.policy import Policy
from specroll_jax.rl.schedule import due
from specroll_jax.rl.scoring import scored
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.factory import build_engine
from specroll_jax.tasks.rewards import REWARD_RULES
from specroll_jax.tasks.sources import Task, load_tasks


@dataclasses.dataclass(frozen=True)
class EvaluationConfig:
  every: int = 0        # updates between evaluations (0 = never; else also before the first)
  count: int = 32       # held-out prompts
  samples: int = 4      # samples per prompt
  source: str = ''      # '' = task.source
  split: str = ''       # e.g. 'test' for a dataset ('' = its default split)
  seed: int = 20261204  # of the held-out draws; the same at every evaluation

  def __post_init__(self):
    if self.every < 0 or self.count < 1 or self.samples < 1:
      raise ValueError(f'evaluation: every must be >= 0, count and samples >= 1, got {self}')


def held_out_tasks(config: EvaluationConfig, training: list[Task], *, task_source: str,
                   data_dir: str, chat_template: bool) -> list[Task]:
  """`config.count` tasks whose prompts are not among the training tasks' prompts (from
  the training's `task_source` unless config.source names another)."""
  trained = {t.prompt for t in training}
  source = config.source or task_source
  # Synthetic tasks are drawn by seed, so a few more than needed leave room for overlaps.
  candidates = load_tasks(source, count=2 * config.count + len(trained), seed=config.seed,
                          data_dir=data_dir or None, split=config.split or None,
                          chat=chat_template)
  kept = [t for t in candidates if t.prompt not in trained][:config.count]
  if len(kept) < config.count:
    raise ValueError(f'config evaluation: {source!r} (split {config.split or "default"!r}) has '
                     f'{len(kept)} prompts outside the training tasks, fewer than count='
                     f'{config.count}')
  return kept


class HeldOutEvaluation:
  """Accuracy and mean reward on the held-out prompts, at the run's one prompt width."""

  def __init__(self, config: EvaluationConfig, policy: Policy, tasks: list[Task], prompts,
               sampler: SamplerConfig, rollout: RolloutConfig, reward_rule: str, mesh=None):
    self.config, self.tasks, self.prompts, self.rule = config, tasks, prompts, reward_rule
    self.tokenizer = policy.tokenizer
    self.driver = Driver(build_engine(policy, 'vanilla', sampler, mesh=mesh), rollout)

  def due(self, updates: int) -> bool:
    """Whether the policy after `updates` GRPO updates (0: the initial one) is evaluated."""
    return due(self.config.every, updates)

  def __call__(self, policy_params, updates: int) -> dict:
    responses = self.driver.generate(self.driver.engine.params(policy_params), self.prompts,
                                     self.config.samples, self.config.seed)
    # Every rule's mean, not only the run's: a run trained on one rule shows what happened
    # to the others (e.g. whether answers got right while the format was being learned).
    by_rule = {rule: scored(rule, self.tasks, responses, self.tokenizer)
               for rule in REWARD_RULES}
    scores = by_rule[self.rule]
    return {'heldout_updates': updates, 'heldout_reward': float(np.mean(scores)),
            'heldout_accuracy': float(np.mean(scores == 1.0)),
            **{f'heldout_{rule}': float(np.mean(s)) for rule, s in by_rule.items()}}
