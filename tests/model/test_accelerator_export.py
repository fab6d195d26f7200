"""The bf16 compute mode's programs lower for the accelerators from this CPU: the decode
loop of both engines and the GRPO train step, exported for cuda and tpu. Nothing here runs
on a device; a lowering that breaks (a CPU-only op, an option, a dtype a platform refuses)
fails here, not on a GPU or TPU host. On those hosts every matmul must take bf16 operands
with float32 results: that is what puts it on the tensor cores and the MXU."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from specroll_jax import load_policy
from specroll_jax.rl import grpo
from specroll_jax.rollout.engine import compiled_run, loop_compiler_options
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.rollout.sequences import Sequences
from specroll_jax.rollout.vanilla import VanillaEngine
from specroll_jax.speculative.engine import SpecEngine
from specroll_jax.speculative.oracle_proposer import OracleParams, OracleProposer
from specroll_jax.speculative.tree import TreeConfig
from tests.conftest import STORIES

PLATFORMS = ('cuda', 'tpu')
ROWS, PROMPT_WIDTH, MAX_NEW = 2, 8, 8
DOT = re.compile(r'stablehlo\.dot_general .*: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> '
                 r'(tensor<[^>]*>)')


@pytest.fixture(scope='module')
def policy():
  return load_policy(STORIES, compute_dtype='bfloat16')


def _operand_and_result_types(module: str) -> set:
  """{(lhs element type, rhs element type, result element type)} of every dot_general."""
  element = lambda tensor: tensor.rsplit('x', 1)[-1].rstrip('>')
  return {tuple(map(element, m.groups())) for m in map(DOT.search, module.splitlines()) if m}


def _engine_module(engine, params, platform):
  seqs = Sequences.empty(jnp.arange(ROWS, dtype=jnp.int32), jnp.full((ROWS,), 3, jnp.int32),
                         jnp.full((ROWS,), MAX_NEW, jnp.int32), MAX_NEW,
                         jnp.zeros((ROWS,), bool))
  state = jax.eval_shape(lambda p, tokens, s: engine.start(p, tokens, s, PROMPT_WIDTH + MAX_NEW),
                         params, jnp.zeros((ROWS, PROMPT_WIDTH), jnp.int32), seqs)
  exported = export.export(compiled_run('cpu'), platforms=[platform])(
      engine, params, state, jax.random.key(0), jnp.int32(0))
  return exported.mlir_module()


@pytest.mark.parametrize('platform', PLATFORMS)
def test_both_decode_loops_export_with_bf16_matmuls(policy, platform):
  sampler = SamplerConfig(temperature=1.0)
  vanilla = VanillaEngine(policy.config, sampler, (ROWS,))
  spec = SpecEngine(policy.config, OracleProposer(4), TreeConfig(capacity_tokens=16, max_nodes=8),
                    sampler, (ROWS,))
  future = OracleParams(None, jnp.zeros((ROWS, MAX_NEW), jnp.int32))
  for engine, proposer_params in ((vanilla, None), (spec, future)):
    module = _engine_module(engine, engine.params(policy.params, proposer_params), platform)
    assert 'stablehlo.while' in module
    assert _operand_and_result_types(module) == {('bf16', 'bf16', 'f32')}


@pytest.mark.parametrize('platform', PLATFORMS)
def test_the_grpo_train_step_exports_with_bf16_forward_matmuls(policy, platform):
  config = grpo.GRPOConfig(group_size=ROWS, micro_batch_size=1)
  tokens = np.full((ROWS, 12), 5, np.int32)
  batch = grpo.RolloutBatch(tokens=jnp.asarray(tokens), response_mask=jnp.ones(tokens.shape, bool),
                            old_logprobs=jnp.zeros(tokens.shape, jnp.float32),
                            advantages=jnp.ones((ROWS,), jnp.float32))
  opt_state = jax.eval_shape(grpo.make_optimizer(config).init, policy.params)
  module = export.export(grpo.train_step, platforms=[platform])(
      policy.config, config, policy.params, opt_state, batch).mlir_module()
  types = _operand_and_result_types(module)
  # The forward's matmuls are bf16 x bf16 -> f32; their gradients contract a float32
  # cotangent with a bf16 operand, in float32 (the learner keeps float32 masters).
  assert ('bf16', 'bf16', 'f32') in types
  assert all(result == 'f32' for *_, result in types), types


def test_the_loop_compiler_options_are_the_cpus_only():
  assert loop_compiler_options('cpu') == {'xla_cpu_copy_insertion_use_region_analysis': True}
  assert loop_compiler_options('gpu') == loop_compiler_options('tpu') == {}
