"""The trainer's exactness and speed audit.

Every `audit.every` GRPO steps the vanilla engine replays the step's rollout: the same
policy parameters, prompts and seed. Under the randomness contract both engines must emit
the same tokens, so the audit counts identical responses and times vanilla against the
rollout the trainer just ran. A response that differs is classified at its first differing
token: the policy's full-sequence forward over the shared prefix gives the logits there,
and `sampling.draw_margin` says how close the contract's scores of the two drawn tokens
were. Below `NEAR_TIE_MARGIN` the engines met a float near-tie (their forwards differ in
the last bits, ~1e-5 on logits); above it the speculative engine broke exactness, which is
logged as an error.
"""
import dataclasses
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from specroll_jax.model.config import ModelConfig
from specroll_jax.model.policy import Policy, full_sequence_logits
from specroll_jax.rl.schedule import due
from specroll_jax.rollout.compilation import count_compilations
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig, draw_margin, log_weights, token_keys
from specroll_jax.speculative.factory import build_engine

# Logits of differently shaped float32 forwards differ by ~1e-5 here (1.2e-4 at most
# against transformers on W3's 30 layers); a contract break moves scores by O(1).
NEAR_TIE_MARGIN = 1e-3


@dataclasses.dataclass(frozen=True)
class AuditConfig:
  """every: audit every N-th GRPO step (0 = never)."""
  every: int = 0

  def __post_init__(self):
    if self.every < 0:
      raise ValueError(f'audit.every must be >= 0, got {self.every}')


@partial(jax.jit, static_argnums=(0, 3))
def _weights_at(config: ModelConfig, params, tokens, sampler: SamplerConfig, position):
  """The sampler's log-weights for the token at `position` of the one row `tokens` [1, T]."""
  logits = full_sequence_logits(config, params, tokens)[0, position - 1]
  return log_weights(logits, sampler)


class Audit:
  """The vanilla side of the audit, compiled at the run's one prompt width."""

  def __init__(self, policy: Policy, config: AuditConfig, sampler: SamplerConfig,
               rollout: RolloutConfig, group_size: int, mesh=None):
    self.config, self.sampler, self.group_size = config, sampler, group_size
    self.policy_config = policy.config
    self.engine = build_engine(policy, 'vanilla', sampler, mesh=mesh)
    self.driver = Driver(self.engine, rollout)
    self.width = rollout.prompt_bucket_min + rollout.max_new_tokens
    self.warm = False

  def due(self, step: int) -> bool:
    """Whether GRPO step `step` (1-based) is audited."""
    return due(self.config.every, step)

  def __call__(self, policy_params, prompts, seed: int, responses, rollout_seconds: float):
    """Metrics of one audited step: `responses` came from the trainer's engine in
    `rollout_seconds` with these parameters, prompts and seed."""
    params = self.engine.params(policy_params)
    if not self.warm:
      # The first audit compiles vanilla's loops; its timing would measure the compiler.
      self.driver.generate(params, prompts, self.group_size, seed)
      self.warm = True
    with count_compilations() as compiled:
      start = time.perf_counter()
      reference = self.driver.generate(params, prompts, self.group_size, seed)
      seconds = time.perf_counter() - start
    margins = [divergence_margin(self.policy_config, policy_params, self.sampler, self.width,
                                 prompts, r, v, seed, self.group_size)
               for r, v in zip(responses, reference) if list(r.token_ids) != list(v.token_ids)]
    near_ties = sum(m < NEAR_TIE_MARGIN for m in margins)
    if near_ties < len(margins):
      logging.error('audit: %d of %d responses differ from vanilla with draw margins %s '
                    '(>= %g): the speculative engine broke the randomness contract',
                    len(margins) - near_ties, len(responses),
                    [m for m in margins if m >= NEAR_TIE_MARGIN], NEAR_TIE_MARGIN)
    return {'audit_responses': len(responses),
            'audit_identical': len(responses) - len(margins),
            'audit_near_ties': int(near_ties),
            'audit_mismatches': len(margins) - int(near_ties),
            'audit_vanilla_seconds': seconds,
            'audit_speedup': seconds / rollout_seconds,
            'audit_vanilla_compilations': compiled()}


def divergence_margin(config: ModelConfig, params, sampler: SamplerConfig, width: int, prompts,
                      response, reference, seed: int, num_samples: int) -> float:
  """The draw margin at the first token where `response` and vanilla's `reference` (the
  same row of a rollout of `prompts` x `num_samples` seeded `seed`) differ, from the
  policy's full-sequence forward over their shared prefix padded to `width` tokens; inf
  where one is a strict prefix of the other, which no draw explains."""
  ours, theirs = list(response.token_ids), list(reference.token_ids)
  first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
  if first is None:
    return float('inf')
  prefix = list(prompts[response.prompt_index]) + theirs[:first]
  tokens = np.zeros((1, width), np.int32)
  tokens[0, :len(prefix)] = prefix
  weights = _weights_at(config, params, jnp.asarray(tokens), sampler, len(prefix))
  row = response.prompt_index * num_samples + response.sample_index  # the driver's order
  key = token_keys(jax.random.key(seed), jnp.int32(row), jnp.int32(len(prefix)))
  return draw_margin(weights, key, ours[first], theirs[first], sampler.greedy)
