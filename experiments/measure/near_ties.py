"""Sampling flips between a tree-shaped forward and vanilla's one-token forward under three
randomness contracts, and what each draw costs: inverse-CDF (the contract before
2026-12-02), Gumbel-max with one number per vocabulary entry, and the two-level Gumbel-max of
rollout/sampling.py (the contract now).

  python -m experiments.measure.near_ties --config=configs/near_ties.py

For each workload the vanilla engine samples responses at T = 1. The policy then re-reads
every response twice with the engines' cached forward, each layout building its own KV cache
as its engine would: one token per forward (the vanilla step) and `block` tokens per forward
over the cache (a chain through a verification tree: the ancestors sit in the block part of
attention, as in the speculative step). At each response position, both layouts' logits are
drawn with `seeds` keys of the contract's form under both contracts. A flip is a (position,
key) whose two draws differ: the per-token rate at which an exact engine's output would
leave vanilla's. Teacher-forcing the same tokens through both layouts measures every
position, where running two engines measures only up to their first divergence.
"""
import json
import platform
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from ml_collections import config_flags

from specroll_jax import load_policy
from specroll_jax.model.kv_cache import commit
from specroll_jax.model.prefill import prefill
from specroll_jax.model.transformer import Transformer, causal_mask
from specroll_jax.rollout import sampling
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.factory import build_engine
from experiments.measure.roofline import call_seconds
from experiments.lib.workloads import benchmark_prompts
from experiments.lib.results import Result, Table, command_line, write, write_json

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/near_ties.py')
CONTRACTS = ('inverse_cdf', 'gumbel_max', 'two_level_gumbel_max')


def inverse_cdf_draw(logits, keys, sampler: SamplerConfig):
  """The contract before 2026-12-02: one uniform per draw against the softmax's CDF."""
  uniform = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys.reshape(-1))
  cdf = jnp.cumsum(sampling.distribution(logits, sampler), axis=-1)
  threshold = uniform.reshape(keys.shape)[..., None] * cdf[..., -1:]
  return jnp.minimum(jnp.sum(cdf <= threshold, axis=-1), logits.shape[-1] - 1).astype(jnp.int32)


def gumbel_max_draw(logits, keys, sampler: SamplerConfig):
  """Gumbel-max with one number per vocabulary entry: the single-level alternative."""
  noise = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(
      keys.reshape(-1)).reshape(keys.shape + (logits.shape[-1],))
  return jnp.argmax(sampling.log_weights(logits, sampler) + noise, axis=-1).astype(jnp.int32)


DRAWS = {'inverse_cdf': inverse_cdf_draw, 'gumbel_max': gumbel_max_draw,
         'two_level_gumbel_max': sampling.draw}


def flips(logits_a, logits_b, seed_keys, response_ids, positions, valid, sampler):
  """Per contract: flips and draws over `valid` positions and every seed key, plus the
  largest logit difference. logits [B, K, V]; response_ids, positions, valid [B, K]."""
  out = {'max_logit_diff': jnp.max(jnp.where(valid[..., None], jnp.abs(logits_a - logits_b), 0.0))}
  for name, draw in DRAWS.items():
    def one_seed(seed_key):
      keys = sampling.token_keys(seed_key, response_ids, positions)
      return jnp.sum((draw(logits_a, keys, sampler) != draw(logits_b, keys, sampler)) & valid)
    out[name] = jnp.sum(jax.lax.map(one_seed, seed_keys))
  return out


@partial(jax.jit, static_argnums=(0, 7))
def read_block(model: Transformer, params, caches, tokens, positions, response_ids, valid,
               sampler, seed_keys):
  """Feeds one block of response tokens [B, K] through both layouts and compares the draws
  for the K positions that follow them."""
  one_token_cache, block_cache = caches
  batch, width = tokens.shape
  project = lambda h: model.apply({'params': params}, h, method=Transformer.project)

  def one_token(cache, column):
    token, position = column
    hidden, kv = model.apply({'params': params}, token[:, None], position[:, None],
                             jnp.ones((batch, 1, 1), bool), cache)
    return commit(cache, kv, jnp.zeros((batch, 1), jnp.int32), jnp.ones(batch, jnp.int32)), \
        project(hidden[:, 0])

  one_token_cache, logits_a = jax.lax.scan(one_token, one_token_cache, (tokens.T, positions.T))
  hidden, kv = model.apply({'params': params}, tokens, positions,
                           causal_mask(jnp.ones((batch, width), bool)), block_cache)
  block_cache = commit(block_cache, kv, jnp.broadcast_to(jnp.arange(width), (batch, width)),
                       jnp.full(batch, width, jnp.int32))
  counts = flips(jnp.swapaxes(logits_a, 0, 1), project(hidden), seed_keys, response_ids,
                 positions + 1, valid, sampler)
  return (one_token_cache, block_cache), counts


def teacher_forced_flips(policy, prompts, responses, c, sampler):
  """Flips per contract over every response position but the first (drawn from the prompt's
  logits, the same in both engines), summed over c.seeds keys."""
  model = Transformer(policy.config)
  lengths = np.array([len(p) for p in prompts])
  width = int(lengths.max())
  prompt_tokens = np.zeros((len(prompts), width), np.int32)
  for row, p in enumerate(prompts):
    prompt_tokens[row, :len(p)] = p
  steps = -(-c.max_new_tokens // c.block) * c.block
  tokens = np.zeros((len(prompts), steps), np.int32)
  response_lengths = np.array([len(r) for r in responses])
  for row, r in enumerate(responses):
    tokens[row, :len(r)] = r
  cache, _, _ = prefill(model, policy.params, jnp.asarray(prompt_tokens), jnp.asarray(lengths),
                        width + steps + 1)
  caches = (cache, cache)
  seed_keys = jax.vmap(jax.random.key)(jnp.arange(c.seeds) + 1000)
  response_ids = jnp.broadcast_to(jnp.arange(len(prompts))[:, None], (len(prompts), c.block))
  totals = {name: 0 for name in CONTRACTS}
  max_diff, draws = 0.0, 0
  for start in range(0, steps, c.block):
    index = start + np.arange(c.block)
    # Feeding response token t gives the logits that draw token t + 1.
    valid = (index + 1)[None, :] < response_lengths[:, None]
    positions = lengths[:, None] + index[None, :]
    caches, counts = read_block(model, policy.params, caches, jnp.asarray(tokens[:, index]),
                                jnp.asarray(positions, jnp.int32), response_ids,
                                jnp.asarray(valid), sampler, seed_keys)
    for name in CONTRACTS:
      totals[name] += int(counts[name])
    max_diff = max(max_diff, float(counts['max_logit_diff']))
    draws += int(valid.sum()) * c.seeds
  return {'draws': draws, 'flips': totals, 'max_logit_diff': max_diff,
          'flip_rate': {name: totals[name] / max(draws, 1) for name in CONTRACTS}}


def median_seconds(fn, *args, repeats):
  return float(np.median(call_seconds(fn, *args, repeats=repeats)))


def draw_costs(policy, batch, cache_length, sampler, repeats):
  """Seconds of one draw per contract at the vanilla step's batch, against the rest of that
  step (the one-token forward over a cache of `cache_length` slots and the projection)."""
  model = Transformer(policy.config)
  params = policy.params
  cache, _, logits = prefill(model, params, jnp.zeros((batch, 8), jnp.int32),
                             jnp.full(batch, 8, jnp.int32), cache_length)
  cache = cache.replace(lengths=jnp.full(batch, cache_length - 1, jnp.int32))
  keys = sampling.token_keys(jax.random.key(0), jnp.arange(batch), jnp.full(batch, 9))

  @jax.jit
  def forward(cache, tokens):
    hidden, _ = model.apply({'params': params}, tokens[:, None], cache.lengths[:, None],
                            jnp.ones((batch, 1, 1), bool), cache)
    return model.apply({'params': params}, hidden[:, 0], method=Transformer.project)

  out = {'forward': median_seconds(forward, cache, jnp.zeros(batch, jnp.int32), repeats=repeats)}
  for name, draw in DRAWS.items():
    out[name] = median_seconds(jax.jit(partial(draw, sampler=sampler)), logits, keys,
                               repeats=repeats)
  return out


def measure(c):
  policy = load_policy(c.checkpoint, c.dtype)
  prompts = benchmark_prompts(policy, c)
  prompts = [p for p in prompts for _ in range(c.samples_per_prompt)]
  sampler = SamplerConfig(temperature=c.temperature)
  engine = build_engine(policy, 'vanilla', sampler)
  responses = Driver(engine, RolloutConfig(c.max_new_tokens, max_batch=len(prompts))).generate(
      policy.params, prompts, 1, c.seed)
  result = teacher_forced_flips(policy, prompts, [r.token_ids for r in responses], c, sampler)
  cache_length = max(len(p) for p in prompts) + c.max_new_tokens
  result['seconds'] = draw_costs(policy, len(prompts), cache_length, sampler, c.repeats)
  result['draw_share_of_step'] = {
      name: result['seconds'][name] / (result['seconds']['forward'] + result['seconds'][name])
      for name in CONTRACTS}
  result.update(responses=len(prompts), vocab_size=policy.config.vocab_size,
                generated_tokens=sum(len(r.token_ids) for r in responses))
  return result


def upper_bound(flips: int, draws: int) -> float:
  """95% upper confidence bound on a rate (exact for zero flips: the rule of three)."""
  if flips == 0:
    return 3.0 / max(draws, 1)
  rate = flips / draws
  return rate + 1.96 * np.sqrt(rate * (1 - rate) / draws)


def main(argv):
  del argv
  c = _CONFIG.value
  out = Path(c.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  command = command_line('experiments.measure.near_ties')
  for key in c.run:
    print(f'== {key}', file=sys.stderr)
    measured = measure(c.workloads[key])
    measured.update(command=command, config=c.workloads[key].to_dict())
    write_json(out / f'{key}.json', measured)
  measured = {key: json.loads((out / f'{key}.json').read_text()) for key in c.workloads
              if (out / f'{key}.json').exists()}
  result = {'backend': jax.default_backend(), 'machine': platform.processor() or platform.machine(),
            'workloads': measured}
  for key, m in measured.items():
    f = m['flips']
    result[f'{key}_flip_reduction'] = (f['inverse_cdf'] / f['two_level_gumbel_max']
                                       if f['two_level_gumbel_max'] else None)
  write(report(measured, result, command), out)


def report(measured, result, command) -> Result:
  rows = [[key, m['vocab_size'], m['draws'], f"{m['max_logit_diff']:.1e}", name,
           m['flips'][name], f"{m['flip_rate'][name]:.2e}",
           f"{upper_bound(m['flips'][name], m['draws']):.1e}", f"{1e3 * m['seconds'][name]:.2f}",
           f"{m['draw_share_of_step'][name]:.1%}"]
          for key, m in measured.items() for name in CONTRACTS]
  return Result(
      'Sampling near-ties: inverse-CDF, Gumbel-max and two-level Gumbel-max', command, result,
      body=[f"Backend {result['backend']}; each workload's command is in results.json.",
            Table(['workload', 'vocab', 'draws (positions x keys)', 'max logit diff', 'contract',
                   'flips', 'flip rate', '95% upper', 'draw ms', 'share of step'], rows,
                  align='lrrrlrrrrr'),
            "A flip is a (response position, seed key) whose draw from the one-token forward's "
            "logits differs from the draw from the block forward's logits. \"share of step\" is "
            "the draw's time over the vanilla step's (one-token forward + projection + draw) at "
            "the workload's batch."])


if __name__ == '__main__':
  app.run(main)
