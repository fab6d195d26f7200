"""Per-response output buffers and the one rule for ending a response (EOS, max length)."""
import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Sequences:
  """What a rollout has emitted so far; every field has the batch as its leading axis."""
  tokens: jax.Array          # int32 [B, N] generated tokens (prompt excluded)
  logprobs: jax.Array        # float32 [B, N] log pi of each generated token
  num_generated: jax.Array   # int32 [B]
  done: jax.Array            # bool [B]
  hit_eos: jax.Array         # bool [B] response ended on an EOS token
  response_ids: jax.Array    # int32 [B] global response index (the RNG stream)
  prompt_lengths: jax.Array  # int32 [B]
  max_new_tokens: jax.Array  # int32 [B]
  steps: jax.Array           # int32 [B] engine steps (policy forwards) taken while running

  @classmethod
  def empty(cls, response_ids, prompt_lengths, max_new_tokens, capacity: int, done):
    batch = response_ids.shape[0]
    return cls(tokens=jnp.zeros((batch, capacity), jnp.int32),
               logprobs=jnp.zeros((batch, capacity), jnp.float32),
               num_generated=jnp.zeros((batch,), jnp.int32), done=done,
               hit_eos=jnp.zeros((batch,), bool), response_ids=response_ids,
               prompt_lengths=prompt_lengths, max_new_tokens=max_new_tokens,
               steps=jnp.zeros((batch,), jnp.int32))

  @property
  def next_positions(self) -> jax.Array:
    """Absolute position of each row's next token (its RNG position)."""
    return self.prompt_lengths + self.num_generated

  def append(self, new_tokens, new_logprobs, count, eos_ids: tuple):
    """Appends up to count[b] of new_tokens[b] to each unfinished row.

    A row keeps tokens up to and including its first EOS and never passes its
    max_new_tokens, exactly where one-token-at-a-time decoding would stop. Returns the
    updated sequences and how many tokens each row actually kept.
    """
    width = new_tokens.shape[1]
    offsets = jnp.arange(width)[None, :]
    is_eos = jnp.isin(new_tokens, jnp.asarray(eos_ids, jnp.int32)) & (offsets < count[:, None])
    has_eos = is_eos.any(axis=1)
    first_eos = jnp.where(has_eos, jnp.argmax(is_eos, axis=1) + 1, width)
    room = self.max_new_tokens - self.num_generated
    kept = jnp.where(self.done, 0, jnp.minimum(jnp.minimum(count, first_eos), room))
    slots = jnp.where(offsets < kept[:, None], self.num_generated[:, None] + offsets,
                      self.tokens.shape[1])
    rows = jnp.arange(new_tokens.shape[0])[:, None]
    ended_on_eos = has_eos & (first_eos <= kept) & ~self.done
    num_generated = self.num_generated + kept
    return self.replace(
        tokens=self.tokens.at[rows, slots].set(new_tokens, mode='drop'),
        logprobs=self.logprobs.at[rows, slots].set(new_logprobs, mode='drop'),
        num_generated=num_generated,
        steps=self.steps + (~self.done).astype(jnp.int32),
        hit_eos=self.hit_eos | ended_on_eos,
        done=self.done | ended_on_eos | (num_generated >= self.max_new_tokens)), kept
