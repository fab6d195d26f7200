"""The vanilla engine: one policy forward per emitted token, the reference for exactness."""
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from specroll_jax.model.config import ModelConfig
from specroll_jax.model.kv_cache import KVCache, commit
from specroll_jax.model.mesh import constrain_rows
from specroll_jax.model.prefill import prefill
from specroll_jax.model.transformer import (Transformer, apply_with_features, compute_params,
                                            final_hidden)
from specroll_jax.rollout import sampling
from specroll_jax.rollout.engine import Engine
from specroll_jax.rollout.sequences import Sequences


@struct.dataclass
class DecodeState:
  cache: KVCache
  next_logits: jax.Array  # float32 [B, V]: the policy's logits for each row's next token
  seqs: Sequences


@dataclasses.dataclass(frozen=True)
class VanillaEngine(Engine):
  model_config: ModelConfig
  sampler: sampling.SamplerConfig
  eos_ids: tuple
  mesh: Mesh | None = None

  @property
  def model(self) -> Transformer:
    return Transformer(self.model_config)

  def params(self, policy_params, proposer_params=None):
    """The pytree `start` and `run` take: the policy's parameters alone, as the compute
    mode reads them."""
    del proposer_params
    return compute_params(self.model_config, policy_params)

  @partial(jax.jit, static_argnums=(0, 4))
  def start(self, params, prompt_tokens, seqs: Sequences, cache_length: int) -> DecodeState:
    cache, _, logits = prefill(self.model, params, prompt_tokens, seqs.prompt_lengths,
                               cache_length)
    return constrain_rows(self.mesh, DecodeState(cache=cache, next_logits=logits, seqs=seqs))

  def step(self, params, state: DecodeState, seed_key) -> DecodeState:
    """Draws one token per running row and runs it through the policy."""
    _, cache, logits, seqs = decode_one(self.model, params, state.cache, state.next_logits,
                                        state.seqs, seed_key, self.sampler, self.eos_ids)
    return constrain_rows(self.mesh, DecodeState(cache=cache, next_logits=logits, seqs=seqs))


def decode_one(model: Transformer, params, cache: KVCache, next_logits, seqs: Sequences,
               seed_key, sampler: sampling.SamplerConfig, eos_ids: tuple,
               feature_layers: tuple = ()):
  """The vanilla step: each row draws its next token from `next_logits`, which then runs
  through the policy alone. Returns (the features [B, F] at that token: its final hidden
  state, then the outputs of decoder `feature_layers` (apply_with_features); cache; its
  logits [B, V]; seqs). Stages are named scopes, as in the speculative step."""
  positions = seqs.next_positions
  with jax.named_scope('root_draw'):
    tokens, logprobs = sampling.draw_next(next_logits, seed_key, seqs.response_ids, positions,
                                          sampler)
  ones = jnp.ones((tokens.shape[0], 1, 1), bool)
  with jax.named_scope('verify_forward'):
    features, block = apply_with_features(model, params, feature_layers, tokens[:, None],
                                          positions[:, None], ones, cache)
  with jax.named_scope('commit'):
    seqs, kept = seqs.append(tokens[:, None], logprobs[:, None], jnp.ones_like(tokens), eos_ids)
    cache = commit(cache, block, jnp.zeros_like(tokens)[:, None], kept)
  with jax.named_scope('project'):
    logits = model.apply({'params': params}, final_hidden(model.config, features[:, 0]),
                         method=Transformer.project)
  return features[:, 0], cache, logits, seqs
