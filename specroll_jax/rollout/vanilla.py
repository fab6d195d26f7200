"""The vanilla engine: one policy forward per emitted token, the reference for exactness."""
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from specroll_jax.rollout import sampling
from specroll_jax.model.config import ModelConfig
from specroll_jax.model.kv_cache import KVCache, commit
from specroll_jax.model.mesh import constrain_rows
from specroll_jax.model.transformer import Transformer
from specroll_jax.rollout.driver import prefill
from specroll_jax.rollout.sequences import Sequences


@struct.dataclass
class DecodeState:
  cache: KVCache
  next_logits: jax.Array  # float32 [B, V]: the policy's logits for each row's next token
  seqs: Sequences


def running_count(seqs: Sequences) -> jax.Array:
  return jnp.sum(~seqs.done)


@dataclasses.dataclass(frozen=True)
class VanillaEngine:
  model_config: ModelConfig
  sampler: sampling.SamplerConfig
  eos_ids: tuple
  mesh: Mesh | None = None

  @property
  def model(self) -> Transformer:
    return Transformer(self.model_config)

  @partial(jax.jit, static_argnums=(0, 4))
  def start(self, params, prompt_tokens, seqs: Sequences, cache_length: int) -> DecodeState:
    cache, _, logits = prefill(self.model, params, prompt_tokens, seqs.prompt_lengths,
                               cache_length)
    return constrain_rows(self.mesh, DecodeState(cache=cache, next_logits=logits, seqs=seqs))

  @partial(jax.jit, static_argnums=0)
  def run(self, params, state: DecodeState, seed_key, stop_at_active) -> DecodeState:
    def keep_going(s):
      running = running_count(s.seqs)
      return (running > 0) & (running > stop_at_active)

    return jax.lax.while_loop(keep_going, lambda s: self.step(params, s, seed_key), state)

  @staticmethod
  def row_stats(state: DecodeState) -> dict:
    del state
    return {}

  def step(self, params, state: DecodeState, seed_key) -> DecodeState:
    """Draws one token per running row and runs it through the policy."""
    seqs = state.seqs
    positions = seqs.next_positions
    keys = sampling.token_keys(seed_key, seqs.response_ids, positions)
    tokens = sampling.draw(state.next_logits, keys, self.sampler)
    logprobs = sampling.token_logprob(state.next_logits, tokens, self.sampler)
    seqs, kept = seqs.append(tokens[:, None], logprobs[:, None],
                             jnp.ones_like(tokens), self.eos_ids)
    ones = jnp.ones((tokens.shape[0], 1, 1), bool)
    hidden, block = self.model.apply({'params': params}, tokens[:, None], positions[:, None],
                                     ones, state.cache)
    cache = commit(state.cache, block, jnp.zeros_like(tokens)[:, None], kept)
    logits = self.model.apply({'params': params}, hidden[:, 0], method=Transformer.project)
    return constrain_rows(self.mesh, DecodeState(cache=cache, next_logits=logits, seqs=seqs))
