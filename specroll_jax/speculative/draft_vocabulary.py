"""A frequency-ranked draft vocabulary: the tokens a proposer may draft.

A proposer that projects its states through the policy's vocabulary matrix W pays for every
row of W it reads, at every depth, in every tree step and every training step. Restricting
it to the tokens most frequent as next tokens in its training text (FR-Spec does the same)
reads V_d rows instead of V: 8,192 of SmolLM2's 49,152 cover 0.958 of held-out drawn tokens
(notes/history.md, issue 29). Tokens outside it are never drafted; the verifier still draws
from the policy's whole distribution, so exactness does not depend on it.
"""
import jax.numpy as jnp
import numpy as np

# The draft vocabulary's tensor name in a proposer's safetensors file (heads and drafter).
VOCAB_TENSOR = 'draft_vocab'


def frequency_vocabulary(tokens, valid, size: int, vocab_size: int) -> np.ndarray:
  """The `size` ids most frequent among the valid `tokens` (ties: lower id first), ascending;
  ids never seen fill the rest by id, so the vocabulary always has `size` entries."""
  counts = np.bincount(np.asarray(tokens)[np.asarray(valid)].ravel(), minlength=vocab_size)
  ranked = np.lexsort((np.arange(vocab_size), -counts[:vocab_size]))
  return np.sort(ranked[:size]).astype(np.int32)


def vocabulary_index(vocab_ids, ids):
  """(column of each id in the ascending draft vocabulary `vocab_ids`, whether it is there)."""
  index = jnp.clip(jnp.searchsorted(vocab_ids, ids), 0, vocab_ids.shape[0] - 1)
  return index, vocab_ids[index] == ids


def check_vocabulary(vocab_ids, size: int, vocab_size: int, file) -> None:
  """A loaded draft vocabulary must have `size` ascending ids inside the policy's vocabulary;
  the error names the file and tensor."""
  vocab_ids = None if vocab_ids is None else np.asarray(vocab_ids)
  if vocab_ids is None or vocab_ids.shape != (size,):
    shape = None if vocab_ids is None else tuple(vocab_ids.shape)
    raise ValueError(f'{file}: tensor {VOCAB_TENSOR!r} has shape {shape}, the config '
                     f'needs ({size},)')
  if size and (int(vocab_ids.min()) < 0 or int(vocab_ids.max()) >= vocab_size):
    raise ValueError(f'{file}: tensor {VOCAB_TENSOR!r} holds ids outside this policy\'s '
                     f'vocabulary of {vocab_size}')
  if np.any(np.diff(vocab_ids) <= 0):
    raise ValueError(f'{file}: tensor {VOCAB_TENSOR!r} is not strictly ascending (a draft '
                     'vocabulary is looked up by binary search)')
