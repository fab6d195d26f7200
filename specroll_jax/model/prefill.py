"""Prefill: right-padded prompts through the policy into a fresh KV cache."""
import jax.numpy as jnp

from specroll_jax.model.kv_cache import KVCache, commit
from specroll_jax.model.transformer import (Transformer, apply_with_features, causal_mask,
                                            final_hidden)


def prefill(model: Transformer, params, prompt_tokens, prompt_lengths, cache_length: int,
            feature_layers: tuple = ()):
  """Runs right-padded prompts [B, P] into a fresh cache of `cache_length` slots.

  Returns the cache, the features at each row's last prompt token (the final hidden state,
  then the outputs of decoder `feature_layers`: apply_with_features) and the logits there.
  """
  batch, width = prompt_tokens.shape
  positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
  valid = positions < prompt_lengths[:, None]
  features, block = apply_with_features(model, params, feature_layers, prompt_tokens, positions,
                                        causal_mask(valid))
  cache = KVCache.zeros(model.config, batch, cache_length)
  cache = commit(cache, block, positions, prompt_lengths)
  last = jnp.take_along_axis(features, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
  logits = model.apply({'params': params}, final_hidden(model.config, last),
                       method=Transformer.project)
  return cache, last, logits
