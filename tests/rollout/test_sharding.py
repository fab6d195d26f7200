"""Rollouts sharded over 8 host CPU devices give the same tokens as on one device."""
import jax
import pytest

from specroll_jax.model.mesh import MeshConfig, make_mesh, shard_params
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.rollout.vanilla import VanillaEngine

PROMPTS = ['Once upon a time', 'The cat sat', 'Lily and Tom went to the park', 'Hi', 'Sue']


def _rollout(policy, mesh):
  sampler = SamplerConfig(temperature=1.0, top_p=0.95)
  engine = VanillaEngine(policy.config, sampler, (2,), mesh=mesh)
  driver = Driver(engine, RolloutConfig(max_new_tokens=20, max_batch=16))
  params = shard_params(mesh, policy.params) if mesh else policy.params
  prompts = [policy.tokenizer.encode(p) for p in PROMPTS]
  return [(o.token_ids, o.finish_reason) for o in driver.generate(params, prompts, 3, seed=5)]


@pytest.mark.parametrize('mesh_config', [MeshConfig(data=8), MeshConfig(data=2, fsdp=2, tensor=2)])
def test_sharded_rollout_equals_unsharded(stories_policy, mesh_config):
  assert jax.device_count() == 8
  assert _rollout(stories_policy, make_mesh(mesh_config)) == _rollout(stories_policy, None)
