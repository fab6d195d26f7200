"""The trainer's audit: vanilla replays a rollout, and a response that differs is told apart
as a float near-tie or a break of the randomness contract."""
import dataclasses

from specroll_jax.rl.audit import NEAR_TIE_MARGIN, Audit, AuditConfig, divergence_margin
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.factory import build_engine


def test_audit_counts_identical_responses_and_flags_a_contract_break(stories_policy):
  policy, sampler = stories_policy, SamplerConfig(temperature=1.0)
  rollout = RolloutConfig(max_new_tokens=12, max_batch=8, prompt_bucket_min=16)
  prompts = [policy.prompt_ids(text, False) for text in ('Once upon a time', 'The cat')]
  audit = Audit(policy, AuditConfig(every=2), sampler, rollout, group_size=2)
  assert [audit.due(step) for step in (1, 2, 3, 4)] == [False, True, False, True]
  responses = Driver(build_engine(policy, 'vanilla', sampler), rollout).generate(
      policy.params, prompts, 2, seed=3)
  clean = audit(policy.params, prompts, 3, responses, rollout_seconds=1.0)
  assert (clean['audit_identical'], clean['audit_near_ties'], clean['audit_mismatches']) == (4, 0, 0)
  assert clean['audit_vanilla_compilations'] == 0
  # One token replaced by another id: no float noise explains the difference.
  tokens = list(responses[1].token_ids)
  tokens[5] = (tokens[5] + 7) % policy.config.vocab_size
  broken = [responses[0], dataclasses.replace(responses[1], token_ids=tokens), *responses[2:]]
  result = audit(policy.params, prompts, 3, broken, rollout_seconds=1.0)
  assert (result['audit_identical'], result['audit_near_ties'], result['audit_mismatches']) == (3, 0, 1)
  margin = divergence_margin(policy.config, policy.params, sampler, audit.width, prompts,
                             broken[1], responses[1], 3, 2)
  assert margin >= NEAR_TIE_MARGIN, margin
