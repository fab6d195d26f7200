"""The GRPO learner step's FLOP rate against this machine's matmul rate.

  python -m experiments.profile.learner --config=configs/bench_w1.py

Times `grpo.train_step` on a batch of the config's shape (prompts_per_step x group_size
rows, the trainer's width, the task's own prompts and full-length random responses). The
step's FLOPs come from XLA's cost analysis of one micro-batch's loss gradient (forward and
backward, attention and the vocabulary projection included) times the number of
micro-batches: the step runs them under lax.scan, and XLA's analysis of a loop counts its
body once. The optimizer's elementwise update is left out. The roof is the rate of one large
float32 matmul on the same backend. Memory: XLA's temporary buffers of the compiled step
(what its activations, logits and gradients need beyond the arguments and outputs), and the
process's peak resident set.
"""
import dataclasses
import resource
import statistics
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from specroll_jax.model.policy import load_policy
from specroll_jax.rl import grpo
from specroll_jax.rl.rollouts import run_prompt_width
from specroll_jax.rl.run import resolve_policy
from specroll_jax.rl.run_config import run_config
from specroll_jax.tasks.sources import load_tasks
from experiments.lib.common import trainer_part
from experiments.lib.results import Result, Table, command_line, write

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/bench_w1.py')
flags.DEFINE_integer('repeats', 3, 'Timed train steps after the compiling one.')
flags.DEFINE_integer('matmul_size', 2048, 'n of the n x n x n float32 matmul that sets the roof.')
flags.DEFINE_string('out_dir', 'results/profile_learner', 'Where results.json and README.md go.')
FLAGS = flags.FLAGS


def flops_of(compiled) -> float:
  analysis = compiled.cost_analysis()
  if isinstance(analysis, list):  # older jax returns one dict per computation
    analysis = analysis[0]
  return float(analysis['flops'])


def timed(fn, repeats: int) -> float:
  """Median seconds of `repeats` calls after one warm-up call."""
  jax.block_until_ready(fn())
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    samples.append(time.perf_counter() - start)
  return statistics.median(samples)


def matmul_rate(n: int, repeats: int) -> float:
  """FLOP/s of an n x n x n float32 matmul."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  matmul = jax.jit(jnp.matmul)
  return 2 * n ** 3 / timed(lambda: matmul(a, a), repeats)


def micro_batch_flops(policy, config: grpo.GRPOConfig, batch: grpo.RolloutBatch) -> float:
  """XLA's FLOP count of the loss gradient on the first micro-batch of `batch`: the model's
  own work, so counted with the logits whole (streamed, they are projected again, and
  inside a loop whose body XLA's analysis counts once)."""
  config = dataclasses.replace(config, stream_logits=False)
  weights = grpo.loss_weights(config.loss_aggregation, batch.response_mask)
  rows = slice(0, config.micro_batch_size)
  micro = jax.tree.map(lambda x: x[rows], batch)
  gradient = jax.jit(jax.grad(partial(grpo.grpo_loss, policy.config, config), has_aux=True))
  return flops_of(gradient.lower(policy.params, micro, weights[rows]).compile())


def learner_batch(policy, c) -> grpo.RolloutBatch:
  """The first GRPO step's prompts, at the width the trainer gives the whole run."""
  r = c.rollout
  tasks = load_tasks(c.task.source, count=c.task.count, seed=c.seed,
                     data_dir=c.task.data_dir or None, split=c.task.split or None,
                     chat=c.task.chat_template)
  all_prompts = [policy.prompt_ids(t.prompt, c.task.chat_template) for t in tasks]
  prompts = all_prompts[:r.prompts_per_step]
  rows = [p for p in prompts for _ in range(r.group_size)]
  rng = np.random.default_rng(0)
  new_tokens = r.driver.max_new_tokens
  responses = [list(rng.integers(0, policy.config.vocab_size, new_tokens)) for _ in rows]
  logprobs = [[-1.0] * new_tokens for _ in rows]
  advantages = rng.standard_normal(len(rows)).astype(np.float32)
  width = run_prompt_width(all_prompts) + new_tokens
  return grpo.batch_from_rollouts(rows, responses, logprobs, advantages, width)


def main(argv):
  del argv
  c = _CONFIG.value
  run = run_config(trainer_part(c))
  policy = load_policy(resolve_policy(run.policy), dtype=run.policy.dtype,
                       compute_dtype=run.policy.compute_dtype)
  # The harvest is on where the slow path consumes it (the main job's adaptation 'both').
  config = dataclasses.replace(run.grpo, harvest_top_k=run.adaptation.harvest_top_k)
  batch = learner_batch(policy, c)
  num_params = sum(x.size for x in jax.tree.leaves(policy.params))
  step_flops = micro_batch_flops(policy, config, batch) * (batch.tokens.shape[0]
                                                           // config.micro_batch_size)
  # The trainer's update: params and optimizer state donated, each call's outputs the next
  # call's inputs.
  trained = {'params': policy.params,
             'opt_state': grpo.make_optimizer(config).init(policy.params)}
  compiled = grpo.train_step_in_place.lower(policy.config, config, trained['params'],
                                            trained['opt_state'], batch).compile()

  def update():
    trained['params'], trained['opt_state'], *_ = compiled(trained['params'],
                                                           trained['opt_state'], batch)
    return trained['params']

  seconds = timed(update, FLAGS.repeats)
  roof = matmul_rate(FLAGS.matmul_size, FLAGS.repeats)
  memory = compiled.memory_analysis()
  result = {
      'backend': jax.default_backend(), 'rows': int(batch.tokens.shape[0]),
      'width': int(batch.tokens.shape[1]), 'micro_batch_size': config.micro_batch_size,
      'harvest_top_k': config.harvest_top_k, 'stream_logits': config.stream_logits,
      'policy_parameters': int(num_params),
      'step_seconds': seconds, 'step_gflop': step_flops / 1e9,
      'step_gflop_per_s': step_flops / seconds / 1e9,
      'matmul_gflop_per_s': roof / 1e9, 'fraction_of_matmul_rate': step_flops / seconds / roof,
      'temp_mib': memory.temp_size_in_bytes / 2**20,
      # Linux reports ru_maxrss in KiB.
      'peak_rss_mib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
  }
  table = Table(['rows x width', 'streamed logits', 'parameters', 'step s', 'GFLOP (XLA)',
                 'GFLOP/s', 'matmul GFLOP/s', 'share', 'temp MiB', 'peak RSS MiB'],
                [[f"{result['rows']} x {result['width']}", config.stream_logits,
                  f'{num_params:,}', f'{seconds:.3f}', f"{result['step_gflop']:.2f}",
                  f"{result['step_gflop_per_s']:.1f}", f"{result['matmul_gflop_per_s']:.1f}",
                  f"{result['fraction_of_matmul_rate']:.1%}", f"{result['temp_mib']:.0f}",
                  f"{result['peak_rss_mib']:.0f}"]], align='l' + 'r' * 9)
  write(Result('GRPO learner step (profile.learner)', command_line('experiments.profile.learner'),
               result, body=[f"Backend {result['backend']}.", table]), FLAGS.out_dir)


if __name__ == '__main__':
  app.run(main)
