"""Prefill: right-padded prompts through the policy into a fresh KV cache."""
import jax.numpy as jnp

from specroll_jax.model.kv_cache import KVCache, commit
from specroll_jax.model.transformer import Transformer, causal_mask


def prefill(model: Transformer, params, prompt_tokens, prompt_lengths, cache_length: int):
  """Runs right-padded prompts [B, P] into a fresh cache of `cache_length` slots.

  Returns the cache and the final hidden state and logits at each row's last prompt token.
  """
  batch, width = prompt_tokens.shape
  positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
  valid = positions < prompt_lengths[:, None]
  hidden, block = model.apply({'params': params}, prompt_tokens, positions, causal_mask(valid))
  cache = KVCache.zeros(model.config, batch, cache_length)
  cache = commit(cache, block, positions, prompt_lengths)
  last = jnp.take_along_axis(hidden, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
  logits = model.apply({'params': params}, last, method=Transformer.project)
  return cache, last, logits
