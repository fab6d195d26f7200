"""The sampler and the randomness contract shared by every rollout engine.

Randomness contract: the token at absolute sequence position `pos` (0-based, counting the
prompt) of response `r` is drawn by two-level Gumbel-max over w = transform(logits), padded
with -inf to nb blocks of b = block_size(V) consecutive ids:

    key = fold_in(fold_in(PRNGKey(seed), r), pos)
    j = argmax_k (logsumexp(w[block k]) + gumbel(fold_in(key, 0), (nb,))[k])
    i = argmax_i (w[block j][i] + gumbel(fold_in(fold_in(key, 1), j), (b,))[i])
    token = j * b + i

Gumbel-max picks block k with probability softmax(block log-masses)_k and then token i with
probability softmax(w[block j])_i, so the token has probability softmax(w)_token exactly. A
draw depends only on (seed, response index, position) and the policy's logits there, never
on batch layout, step count or how many tokens an engine emits per step. The speculative
engine reproduces vanilla's draws by evaluating the same key at each tree node. Greedy
decoding (temperature 0) is argmax of the raw logits.

Why this and not inverse-CDF (one uniform against the cumulative softmax, the contract
until 2026-12-02): differently shaped forwards (a tree of nodes, one token per row) give
logits that differ in the last float bits, ~1e-5. Inverse-CDF picks by where u falls among V
cumulative boundaries, and a 49k vocabulary's long tail puts boundaries 1e-7 apart, so such
shifts moved 2 of 16 SmolLM2 responses (256 tokens, T = 1) to a neighbouring id. Gumbel-max
moves a pick only when the best two perturbed scores are within the logit error, and their
gap is of order one. Two levels, because one Gumbel number per vocabulary entry cost 21 ms
per draw of 16 rows x 49k on the 2-core CPU (15% of a SmolLM2 decode step); nb + b ~ 2 sqrt(V)
numbers cost 0.8 ms, less than inverse-CDF's cumulative sum (5.4 ms). Flip rates and costs:
notes/history.md, "Sampling near-ties".
"""
import dataclasses
import math

import jax
import jax.numpy as jnp

from specroll_jax.model import invariant


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
    probs = jnp.exp(invariant.log_softmax(sorted_x))
    mass_before = jax.lax.associative_scan(jnp.add, probs, axis=-1) - probs
    keep = jnp.sum(mass_before < sampler.top_p, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(sorted_x, keep - 1, axis=-1)
    x = jnp.where(x >= threshold, x, -jnp.inf)
  return x


def log_weights(logits: jax.Array, sampler: SamplerConfig) -> jax.Array:
  """What a draw maximises before noise: the transformed logits, or the raw ones when
  greedy; removed tokens are -inf."""
  if sampler.greedy:
    return logits.astype(jnp.float32)
  return transform_logits(logits, sampler)


def distribution(logits: jax.Array, sampler: SamplerConfig) -> jax.Array:
  """The sampler's distribution S(logits) (raw softmax when greedy): what proposals and
  verifier feedback compare."""
  return jnp.exp(invariant.log_softmax(log_weights(logits, sampler)))


def block_size(vocab_size: int) -> int:
  """b, the power of two nearest sqrt(V): the two levels then draw about as many numbers."""
  return 2 ** max(0, round(math.log2(math.sqrt(vocab_size))))


def _blocks(weights: jax.Array) -> jax.Array:
  """weights [V] padded with -inf to [nb, b]: the contract's blocks of consecutive ids."""
  b = block_size(weights.shape[-1])
  blocks = -(-weights.shape[-1] // b)
  return jnp.pad(weights, (0, blocks * b - weights.shape[-1]),
                 constant_values=-jnp.inf).reshape(blocks, b)


def _block_scores(w: jax.Array, key: jax.Array) -> jax.Array:
  """The first level's perturbed scores, one per block of `w` [nb, b]."""
  noise = jax.random.gumbel(jax.random.fold_in(key, 0), (w.shape[0],), jnp.float32)
  return invariant.logsumexp(w) + noise


def _token_scores(w: jax.Array, key: jax.Array, block: jax.Array) -> jax.Array:
  """The second level's perturbed scores of the ids in `block`."""
  noise = jax.random.gumbel(jax.random.fold_in(jax.random.fold_in(key, 1), block),
                            (w.shape[1],), jnp.float32)
  return w[block] + noise


def two_level_gumbel_max(weights: jax.Array, key: jax.Array) -> jax.Array:
  """One draw from softmax(weights [V]) under the contract."""
  w = _blocks(weights)
  j = jnp.argmax(_block_scores(w, key))
  return (j * w.shape[1] + jnp.argmax(_token_scores(w, key, j))).astype(jnp.int32)


def draw_margin(weights: jax.Array, key: jax.Array, token_a: int, token_b: int,
                greedy: bool) -> float:
  """How far apart the contract puts two tokens' scores, at the level where one draw chose
  between them (the block level when they lie in different blocks, else the token level;
  the raw logits when greedy). Two engines that drew a and b from logits this close to
  each other met a float near-tie; a margin of order one means one of them broke the
  contract."""
  if greedy:
    return float(jnp.abs(weights[token_a] - weights[token_b]))
  w = _blocks(weights)
  b = w.shape[1]
  block_a, block_b = token_a // b, token_b // b
  if block_a != block_b:
    scores = _block_scores(w, key)
    return float(jnp.abs(scores[block_a] - scores[block_b]))
  scores = _token_scores(w, key, jnp.int32(block_a))
  return float(jnp.abs(scores[token_a % b] - scores[token_b % b]))


def draw(logits: jax.Array, keys: jax.Array, sampler: SamplerConfig,
         weights: jax.Array | None = None) -> jax.Array:
  """Draws one token per leading index: logits [..., V], keys [...] -> int32 [...].

  weights: `log_weights(logits, sampler)` when the caller has already computed it (the
  verifier also keeps the distribution's top-M), so the transform (a sort under top-p)
  runs once.
  """
  if weights is None:
    weights = log_weights(logits, sampler)
  if sampler.greedy:
    return jnp.argmax(weights, axis=-1).astype(jnp.int32)
  flat = weights.reshape(-1, weights.shape[-1])
  return jax.vmap(two_level_gumbel_max)(flat, keys.reshape(-1)).reshape(keys.shape)


def token_logprob(logits: jax.Array, tokens: jax.Array, sampler: SamplerConfig) -> jax.Array:
  """log pi(token) under softmax(logits / T) (T=1 when greedy), before top-k/top-p.

  This is the quantity a GRPO learner recomputes from a full-sequence forward, so rollout
  log-probs can stand in for the behaviour policy's log-probs.
  """
  scale = 1.0 if sampler.greedy else sampler.temperature
  logp = invariant.log_softmax(logits.astype(jnp.float32) / scale)
  return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def draw_next(logits: jax.Array, seed_key, response_ids, positions, sampler: SamplerConfig):
  """Each row's token at `positions` under the contract, with its rollout log-prob."""
  tokens = draw(logits, token_keys(seed_key, response_ids, positions), sampler)
  return tokens, token_logprob(logits, tokens, sampler)
