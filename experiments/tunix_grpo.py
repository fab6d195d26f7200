"""tunix's GRPO learner with this project's rollouts, on a tiny Qwen2-shaped model.

  python3 -m pip install --no-deps -r requirements-tunix.txt
  python3 -m experiments.tunix_grpo --steps=4 --engine=specroll

tunix (google-tunix) builds the cluster, the learner and the optimizer as it always does;
only `ClusterConfig.rollout_engine` changes, to `SpecRollRollout`
(specroll_jax/integrations/tunix.py). The model is a randomly initialised 2-layer tunix Qwen2
with the stories260K tokenizer, rewarded for longer completions so that its updates are
visible in a few steps; a real run loads its tunix model and tokenizer instead. Prints each
step's mean reward and completion length, and the rollouts' share of the wall time.
"""
import functools
import time

import jax
import numpy as np
import optax
from absl import app, flags
from flax import nnx
from transformers import AutoTokenizer
from tunix.models.qwen2 import model as qwen2
from tunix.rl import rl_cluster
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout

from specroll_jax.integrations.tunix import SpecRollRollout
from specroll_jax.tasks.paths import STORIES260K_DIR

_STEPS = flags.DEFINE_integer('steps', 4, 'GRPO steps (global steps of tunix).')
_ENGINE = flags.DEFINE_enum('engine', 'specroll', ['specroll', 'vanilla'],
                            "This project's engine inside tunix: the same tokens either way.")
_GROUP = flags.DEFINE_integer('group_size', 4, 'Samples per prompt (num_generations).')
_MAX_TOKENS = flags.DEFINE_integer('max_tokens', 32, 'Tokens generated per sample at most.')

PROMPTS = ('Once upon a time', 'The little cat', 'Tom and Lily', 'One day a bird')


def tiny_qwen2(seed: int = 0) -> qwen2.Qwen2:
  """A 2-layer Qwen2 over the stories260K vocabulary (512 tokens)."""
  config = qwen2.ModelConfig(num_layers=2, vocab_size=512, embed_dim=64, hidden_dim=128,
                             num_heads=4, head_dim=16, num_kv_heads=2, rope_theta=10000,
                             norm_eps=1e-5)
  return qwen2.Qwen2(config, rngs=nnx.Rngs(seed))


def rollout_config(max_tokens: int, **overrides) -> base_rollout.RolloutConfig:
  return base_rollout.RolloutConfig(**{
      'max_tokens_to_generate': max_tokens, 'max_prompt_length': 32, 'temperature': 1.0,
      'top_p': 1.0, 'seed': 0, 'return_logprobs': True, **overrides})


def make_cluster(actor, tokenizer, rollouts: base_rollout.RolloutConfig, steps: int,
                 **engine_settings) -> rl_cluster.RLCluster:
  """tunix's cluster on one device, its rollouts from SpecRollRollout(**engine_settings)."""
  # tunix shards with with_sharding_constraint, which takes Auto mesh axes only.
  mesh = jax.make_mesh((1, 1), ('fsdp', 'tp'), devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  config = rl_cluster.ClusterConfig(
      role_to_mesh={role: mesh for role in (rl_cluster.Role.ACTOR, rl_cluster.Role.REFERENCE,
                                            rl_cluster.Role.ROLLOUT)},
      rollout_engine=functools.partial(SpecRollRollout, **engine_settings),
      offload_to_cpu=False,
      training_config=rl_cluster.RLTrainingConfig(actor_optimizer=optax.adamw(1e-2),
                                                  eval_every_n_steps=steps + 1,
                                                  max_steps=steps),
      rollout_config=rollouts)
  return rl_cluster.RLCluster(actor=actor, tokenizer=tokenizer, cluster_config=config)


def length_reward(prompts, completions, **kwargs):
  """Longer completions earn more: a signal that moves a random policy within a few steps."""
  del prompts, kwargs
  return [len(c) / 50.0 for c in completions]


def grpo(cluster, group_size: int) -> grpo_learner.GRPOLearner:
  return grpo_learner.GRPOLearner(
      rl_cluster=cluster, reward_fns=[length_reward],
      algo_config=grpo_learner.GRPOConfig(num_generations=group_size, num_iterations=1,
                                          beta=0.0))


def main(argv):
  del argv
  tokenizer = AutoTokenizer.from_pretrained(str(STORIES260K_DIR))
  cluster = make_cluster(tiny_qwen2(), tokenizer, rollout_config(_MAX_TOKENS.value),
                         _STEPS.value, engine=_ENGINE.value, group_size=_GROUP.value)
  engine, seconds = cluster.rollout, []
  generate = engine.generate

  def timed_generate(*args, **kwargs):
    start = time.perf_counter()
    out = generate(*args, **kwargs)
    seconds.append(time.perf_counter() - start)
    lengths = [len(t) for t in out.tokens]
    print(f'step {len(seconds)}: mean reward {np.mean(length_reward(None, out.text)):.3f}, '
          f'mean completion {np.mean(lengths):.1f} tokens, rollout {seconds[-1]:.2f} s')
    return out

  engine.generate = timed_generate
  start = time.perf_counter()
  grpo(cluster, _GROUP.value).train([{'prompts': np.array(PROMPTS)}] * _STEPS.value)
  total = time.perf_counter() - start
  print(f'{_STEPS.value} tunix GRPO steps with {_ENGINE.value} rollouts in {total:.1f} s '
        f'(rollouts {sum(seconds):.1f} s, the first with compilation)')


if __name__ == '__main__':
  app.run(main)
