"""The sampler and the randomness contract shared by every rollout engine.

Randomness contract: the token at absolute sequence position `pos` (0-based, counting the
prompt) of response `r` is drawn with

    key = fold_in(fold_in(PRNGKey(seed), r), pos)
    u = uniform(key)                                   # one number per draw
    token = first v with cdf(v) > u * cdf(V - 1)      # cdf of softmax(transform(logits))

so a draw depends only on (seed, response index, position) and the policy's logits there,
never on batch layout, step count or how many tokens an engine emits per step. Inverse-CDF
sampling needs one random number per draw (Gumbel-max would need V), which keeps the
per-step sampling cost small next to a small policy's forward. The
speculative engine reproduces vanilla's draws by evaluating the same key at each tree node.
Greedy decoding (temperature 0) is argmax of the raw logits.
"""
import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """temperature 0 = greedy; top_k 0 = off; top_p 1.0 = off (applied in that order)."""
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f'temperature must be >= 0, got {self.temperature}')
    if self.top_k < 0:
      raise ValueError(f'top_k must be >= 0, got {self.top_k}')
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f'top_p must be in (0, 1], got {self.top_p}')

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def token_keys(seed_key: jax.Array, response_ids: jax.Array, positions: jax.Array) -> jax.Array:
  """One key per (response, absolute position); shapes of the two id arrays must match."""
  fold = lambda r, p: jax.random.fold_in(jax.random.fold_in(seed_key, r), p)
  flat = jax.vmap(fold)(response_ids.reshape(-1), positions.reshape(-1))
  return flat.reshape(response_ids.shape)


def transform_logits(logits: jax.Array, sampler: SamplerConfig) -> jax.Array:
  """Temperature, then top-k, then top-p; removed tokens get -inf. Ties at a cut are kept."""
  x = logits.astype(jnp.float32) / sampler.temperature
  if sampler.top_k > 0:
    kth = jax.lax.top_k(x, sampler.top_k)[0][..., -1:]
    x = jnp.where(x >= kth, x, -jnp.inf)
  if sampler.top_p < 1.0:
    sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_x, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = jnp.sum(mass_before < sampler.top_p, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(sorted_x, keep - 1, axis=-1)
    x = jnp.where(x >= threshold, x, -jnp.inf)
  return x


def distribution(logits: jax.Array, sampler: SamplerConfig) -> jax.Array:
  """The sampler's distribution S(logits) (raw softmax when greedy): what proposals and
  verifier feedback compare."""
  if sampler.greedy:
    return jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  return jax.nn.softmax(transform_logits(logits, sampler), axis=-1)


def draw(logits: jax.Array, keys: jax.Array, sampler: SamplerConfig, probs=None) -> jax.Array:
  """Draws one token per leading index: logits [..., V], keys [...] -> int32 [...].

  probs: `distribution(logits, sampler)` when the caller has already computed it (the
  verifier also keeps its top-M), so the transform (a sort under top-p) runs once.
  """
  if sampler.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  uniform = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys.reshape(-1))
  if probs is None:
    probs = distribution(logits, sampler)
  cdf = jnp.cumsum(probs, axis=-1)
  threshold = uniform.reshape(keys.shape)[..., None] * cdf[..., -1:]
  # The first token whose cdf passes the threshold has positive mass by construction.
  token = jnp.sum(cdf <= threshold, axis=-1)
  return jnp.minimum(token, logits.shape[-1] - 1).astype(jnp.int32)


def token_logprob(logits: jax.Array, tokens: jax.Array, sampler: SamplerConfig) -> jax.Array:
  """log pi(token) under softmax(logits / T) (T=1 when greedy), before top-k/top-p.

  This is the quantity a GRPO learner recomputes from a full-sequence forward, so rollout
  log-probs can stand in for the behaviour policy's log-probs.
  """
  scale = 1.0 if sampler.greedy else sampler.temperature
  logp = jax.nn.log_softmax(logits.astype(jnp.float32) / scale, axis=-1)
  return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def draw_next(logits: jax.Array, seed_key, response_ids, positions, sampler: SamplerConfig):
  """Each row's token at `positions` under the contract, with its rollout log-prob."""
  tokens = draw(logits, token_keys(seed_key, response_ids, positions), sampler)
  return tokens, token_logprob(logits, tokens, sampler)
