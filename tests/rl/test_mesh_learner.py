"""The learner on one (data, fsdp, tensor) mesh: sharded as the rules say, same update as
one device; the memory report's exact parts match what the devices hold; LoRA."""
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import paper
from specroll_jax.model.config import config_from_hf
from specroll_jax.model.mesh import (MeshConfig, make_mesh, optimizer_sharding, param_sharding,
                                     put_rows)
from specroll_jax.rl import grpo, lora, memory
from specroll_jax.rl.drafter_adaptation import DrafterKind
from specroll_jax.speculative.drafter import DrafterConfig, init_drafter

CONFIG = grpo.GRPOConfig(group_size=4, micro_batch_size=8, learning_rate=1e-3)


def _batch(policy, rows=16, width=48, seed=0):
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(3, policy.config.vocab_size, 6).tolist() for _ in range(rows)]
  responses = [rng.integers(3, policy.config.vocab_size, rng.integers(5, 30)).tolist()
               for _ in range(rows)]
  logprobs = [[-1.0] * len(r) for r in responses]
  advantages = rng.normal(size=rows).astype(np.float32)
  return grpo.batch_from_rollouts(prompts, responses, logprobs, advantages, width)


def _sharded_state(mesh, params, optimizer):
  params = jax.device_put(params, param_sharding(mesh, params))
  opt_state = optimizer.init(params)
  return params, jax.device_put(opt_state, optimizer_sharding(mesh, optimizer, opt_state,
                                                              param_sharding(mesh, params)))


def _specs(tree):
  return [x.sharding.spec for x in jax.tree.leaves(tree)]


def test_sharded_update_equals_one_device_and_keeps_its_shardings(stories_policy):
  params = stories_policy.params
  optimizer = grpo.make_optimizer(CONFIG)
  batch = _batch(stories_policy)
  single = grpo.train_step(stories_policy.config, CONFIG, params, optimizer.init(params), batch)
  mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
  sharded_params, sharded_opt = _sharded_state(mesh, params, optimizer)
  batch = jax.tree.map(lambda x: put_rows(mesh, np.asarray(x)), batch)
  new_params, new_opt, metrics, _ = grpo.train_step(stories_policy.config, CONFIG,
                                                    sharded_params, sharded_opt, batch, mesh=mesh)
  # The weights really are split: stories260K's q_proj is [64, 64], fsdp=4 x tensor=2.
  q = new_params['layers_0']['self_attn']['q_proj']['kernel']
  assert q.sharding.spec == P('fsdp', 'tensor')
  assert q.addressable_shards[0].data.shape == (16, 32)
  # Adam's moments mirror the parameters' shardings; after the update too.
  mu = new_opt[1][0].mu
  assert _specs(mu) == _specs(new_params) == _specs(sharded_params)
  assert mu['layers_0']['mlp']['down_proj']['kernel'].sharding.spec == P('tensor', 'fsdp')
  # Float32 sums in another order (sharded matmuls and all-reduces): the loss, gradient
  # norm and every gradient agree to float32 rounding: 1e-5 relative, and each gradient
  # entry to 1e-5 of its tensor's largest (an entry sums ~1e4 products with cancellation,
  # so its rounding scales with the tensor's magnitude, not its own; measured 1.7e-6).
  for key in ('loss', 'grad_norm', 'entropy'):
    np.testing.assert_allclose(float(metrics[key]), float(single[2][key]), rtol=1e-5)
  gradients = jax.jit(grpo.accumulated_gradients, static_argnums=(0, 1, 5))
  sharded_grads = gradients(stories_policy.config, CONFIG, sharded_params, batch, None, mesh)[0]
  grads = gradients(stories_policy.config, CONFIG, params, _batch(stories_policy), None, None)[0]
  for a, b in zip(jax.tree.leaves(sharded_grads), jax.tree.leaves(grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0,
                               atol=1e-5 * np.abs(np.asarray(b)).max())
  # One AdamW step moves an entry by lr * g / (|g| + eps), whose derivative in g is
  # lr * eps / (|g| + eps)^2: the parameters agree to what the gradients' agreement (dg,
  # above) implies through it, plus the float32 rounding of the parameter itself, and never
  # by more than Adam's bound of lr per entry on each side. Entries far from zero agree to
  # ~1e-7; a few whose gradient is within a few eps of zero differ by up to 0.09 lr.
  eps, lr = 1e-8, CONFIG.learning_rate
  for a, b, g in zip(jax.tree.leaves(new_params), jax.tree.leaves(single[0]),
                     jax.tree.leaves(grads)):
    g = np.abs(np.asarray(g, np.float64))
    dg = 1e-5 * g.max()
    bound = np.minimum(2 * lr, lr * eps * dg / (np.maximum(g - dg, 0) + eps) ** 2)
    difference = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    assert np.all(difference <= bound + 2e-7), (difference - bound).max()


def test_memory_report_matches_the_devices_pieces(stories_policy):
  config = stories_policy.config
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  optimizer = grpo.make_optimizer(CONFIG)
  params, opt_state = _sharded_state(mesh, stories_policy.params, optimizer)
  device = jax.devices()[0]
  held = lambda tree: sum(s.data.nbytes for x in jax.tree.leaves(tree)
                          for s in x.addressable_shards if s.device == device)
  drafter = DrafterConfig()
  workload = memory.Workload(rollout_rows=16, cache_length=64, micro_batch_rows=8,
                             learner_width=64, proposer=DrafterKind().memory(config, drafter))
  parts = dict(memory.report(config, workload, dict(mesh.shape)).parts)
  assert parts['parameters'] == held(params)
  # A whole copy of the block on every device, and two Adam moments like it.
  block = jax.device_put(init_drafter(drafter, config, np.arange(config.vocab_size)).weights,
                         NamedSharding(mesh, P()))
  assert parts['drafter block + its optimizer'] == 3 * held(block)
  assert parts['optimizer (AdamW moments)'] == held(opt_state)
  # One device's rows (16 / 4) x slots x layers x k and v x its KV heads (4 / 2) x head dim.
  assert parts['KV cache (16 rows x 64 slots)'] == 4 * 64 * config.num_layers * 2 * (
      config.num_kv_heads // 2) * config.head_dim * 4


def test_lora_trains_only_adapters_and_starts_at_the_base_policy(stories_policy):
  params = stories_policy.params
  config = grpo.GRPOConfig(group_size=4, micro_batch_size=8, learning_rate=1e-3, lora_rank=4,
                           lora_targets='q_proj,v_proj,down_proj')
  adapters = lora.init_adapters(params, config.lora_rank, config.lora_targets, seed=0)
  merged = lora.merge(params, adapters, config.lora_scale)
  # Zero-initialised B: every weight of the merged policy is the base's, bit for bit.
  for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  optimizer = grpo.make_optimizer(config)
  new_adapters, _, metrics, _ = grpo.train_step(stories_policy.config, config, adapters,
                                                optimizer.init(adapters), _batch(stories_policy),
                                                params)
  assert float(metrics['grad_norm']) > 0
  flat = traverse_util.flatten_dict(new_adapters, sep='/')
  assert sorted({p.split('/')[-2] for p in flat}) == ['down_proj', 'q_proj', 'v_proj']
  assert all(np.abs(np.asarray(v)).max() > 0 for p, v in flat.items() if p.endswith('lora_b'))
  # The policy moves only in the adapted kernels.
  after = traverse_util.flatten_dict(lora.merge(params, new_adapters, config.lora_scale), sep='/')
  before = traverse_util.flatten_dict(params, sep='/')
  changed = {p for p in before if not np.array_equal(np.asarray(after[p]), np.asarray(before[p]))}
  assert changed == {p for p in before if p.split('/')[-2] in ('q_proj', 'v_proj', 'down_proj')
                     and p.endswith('kernel')}


def test_lora_targets_that_match_nothing_are_an_error(stories_policy):
  with pytest.raises(ValueError, match='lora_targets'):
    lora.init_adapters(stories_policy.params, 4, 'qkv', seed=0)


def test_mesh_shapes_and_errors():
  assert MeshConfig(data=-1, fsdp=2, tensor=2).shape(8) == (2, 2, 2)
  assert MeshConfig(data=1, fsdp=-1, tensor=2).shape(8) == (1, 4, 2)
  with pytest.raises(ValueError, match='at most one -1'):
    MeshConfig(data=-1, fsdp=-1).shape(8)
  with pytest.raises(ValueError, match='does not divide'):
    MeshConfig(data=-1, fsdp=3).shape(8)
  with pytest.raises(ValueError, match='does not divide'):
    MeshConfig(data=4, fsdp=4).shape(8)


def test_paper_architectures_have_their_published_sizes():
  # Untied lm_heads included: the memory report counts what a checkpoint holds.
  published = {'qwen2.5-1.5b': 1_543_714_304, 'qwen2.5-7b': 7_615_616_512,
               'llama3.1-8b': 8_030_261_248}
  for name, raw in paper.ARCHITECTURES.items():
    shapes = memory.param_shapes(config_from_hf(raw, Path(name), 'bfloat16'))
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes)) == published[name]
