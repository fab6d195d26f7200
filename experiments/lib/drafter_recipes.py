"""What the drafter comparisons share (experiments.measure.drafter_kinds, drafter_features): one
set of the policy's own answers as distillation pairs, and each compared drafter trained on
them with the same recipe (c.kinds_pairs, c.kinds_training) into c.kinds_dir/<name>, where a
later run finds it.
"""
import dataclasses
import sys
import time
from functools import partial
from pathlib import Path

import jax
import numpy as np

from experiments.lib.workloads import drafter_config, head_training_prompts
from specroll_jax.adapt.distill import WarmStart, generated_pairs
from specroll_jax.adapt.drafter_training import (DrafterTraining, agreement_rates, train_drafter,
                                                 vocabulary_coverage)
from specroll_jax.model.transformer import padded_sequence_features
from specroll_jax.speculative.context_drafter import ContextDrafterConfig
from specroll_jax.speculative.context_drafter_proposer import ContextDrafterProposer
from specroll_jax.speculative.drafter import (DrafterMetadata, has_drafter, load_drafter,
                                              save_drafter)
from specroll_jax.speculative.drafter_proposer import DrafterProposer
from specroll_jax.speculative.pairs import DistillPairs

FIELDS = [f.name for f in dataclasses.fields(DistillPairs)]
FEATURE_ROWS = 8
PROPOSERS = {'drafter': DrafterProposer, 'context_drafter': ContextDrafterProposer}


def kinds(c) -> dict:
  """The compared drafter kinds' configs, of one shape (c.drafter; c.context_heads)."""
  sequential = drafter_config(c.drafter)
  return {'drafter': sequential,
          'context_drafter': ContextDrafterConfig.from_block(sequential, c.context_heads)}


class SharedPairs:
  """The pairs every drafter of a comparison trains on: generated once when one needs them,
  kept in c.kinds_dir/pairs.npz (written aside, then renamed). With `feature_layers`, their
  hidden states are widened with those decoder layers' outputs (`with_layer_features`, over
  the prompts the pairs were generated from; their seconds count as the pairs')."""

  def __init__(self, policy, c, feature_layers: tuple = ()):
    self.policy, self.c, self.pairs = policy, c, None
    self.feature_layers = tuple(feature_layers)
    self.path = Path(c.kinds_dir) / 'pairs.npz'

  def get(self):
    if self.pairs is None and self.path.is_file():
      with np.load(self.path) as saved:
        self.seconds = float(saved['seconds'])
        self.pairs = tuple(DistillPairs(**{f: saved[f'{part}_{f}'] for f in FIELDS})
                           for part in ('train', 'held'))
    if self.pairs is None:
      p, start = self.c.kinds_pairs, time.perf_counter()
      plan = WarmStart(num_sequences=p.num_sequences, held_out=p.held_out,
                       max_new_tokens=p.max_new_tokens, temperature=self.c.temperature,
                       seed=p.seed)
      self.pairs = generated_pairs(self.policy, head_training_prompts(self.policy, self.c, p),
                                   plan, DrafterTraining().target_top_k)
      self.seconds = time.perf_counter() - start
      self.path.parent.mkdir(parents=True, exist_ok=True)
      arrays = {f'{part}_{f}': np.asarray(getattr(pairs, f))
                for part, pairs in zip(('train', 'held'), self.pairs) for f in FIELDS}
      with open(self.path.with_suffix('.tmp'), 'wb') as file:
        np.savez(file, seconds=self.seconds, **arrays)
      self.path.with_suffix('.tmp').replace(self.path)
    if self.feature_layers and self.pairs[0].hidden.shape[-1] == self.policy.config.hidden_size:
      start = time.perf_counter()
      p = self.c.kinds_pairs
      prompts = head_training_prompts(self.policy, self.c, p)
      rows = [prompts[i % len(prompts)] for i in range(p.num_sequences + p.held_out)]
      self.pairs = (
          with_layer_features(self.policy, rows[:p.num_sequences], self.pairs[0],
                              self.feature_layers, self.path),
          with_layer_features(self.policy, rows[p.num_sequences:], self.pairs[1],
                              self.feature_layers, self.path))
      self.seconds += time.perf_counter() - start
    return self.pairs


def with_layer_features(policy, prompt_rows, pairs: DistillPairs, layers: tuple,
                        source) -> DistillPairs:
  """`pairs` (response spans from each row's last prompt token, as distill.generated_pairs
  makes them from `prompt_rows`) with `layers`' outputs after their hidden states (which stay
  bit for bit the other drafters'): one forward over each row's whole sequence, the prompt
  and then the span's response, so every layer sees the context h_t saw; taken at the span's
  positions. `source` names the pairs in errors."""
  valid = np.asarray(pairs.valid)
  tokens = np.asarray(pairs.tokens)
  spans = [row[ok] for row, ok in zip(tokens, valid)]
  for i, (prompt, span) in enumerate(zip(prompt_rows, spans)):
    if not len(span) or span[0] != prompt[-1]:
      raise ValueError(f'{source}: pair row {i} does not start at its prompt\'s last token '
                       '(the pairs were made from other prompts)')
  starts = [len(prompt) - 1 for prompt in prompt_rows]
  width = max(starts) + tokens.shape[1]
  full = np.full((len(spans), width), -1, np.int32)
  for i, (prompt, span) in enumerate(zip(prompt_rows, spans)):
    full[i, :starts[i] + len(span)] = list(prompt[:-1]) + span.tolist()
  dim = policy.config.hidden_size
  outputs = np.concatenate([np.asarray(_features(policy.config, policy.params,
                                                 full[i:i + FEATURE_ROWS], tuple(layers)))
                            for i in range(0, len(full), FEATURE_ROWS)])
  taken = np.stack([outputs[i, start:start + tokens.shape[1], dim:]
                    for i, start in enumerate(starts)])
  return pairs.replace(hidden=np.concatenate([np.asarray(pairs.hidden), taken], axis=-1))


@partial(jax.jit, static_argnums=(0, 3))
def _features(model_config, params, tokens, layers: tuple):
  return padded_sequence_features(model_config, params, tokens, layers)


def trained(policy, c, pairs: SharedPairs, name, config):
  """(config, params) of the drafter `name` (`config`: its kind and shape), trained into
  c.kinds_dir/name when missing."""
  directory = Path(c.kinds_dir) / name
  if not has_drafter(directory, type(config)):
    train, held = pairs.get()
    t, start = c.kinds_training, time.perf_counter()
    print(f'training {name} into {directory}', file=sys.stderr)
    params, loss = train_drafter(policy, config, DrafterTraining(
        batch_size=t.batch_size, steps=t.steps, learning_rate=t.learning_rate), train,
        c.kinds_pairs.seed)
    top1, mass = agreement_rates(config, policy.config, params, policy.params, held)
    save_drafter(directory, config, params, DrafterMetadata(
        source=c.checkpoint, num_sequences=c.kinds_pairs.num_sequences,
        positions=int(train.valid.sum()), steps=t.steps, final_loss=loss,
        seconds=pairs.seconds + time.perf_counter() - start, top1_by_depth=top1.tolist(),
        mass_by_depth=mass.tolist(), vocab_coverage=vocabulary_coverage(params.vocab_ids, held)))
  return load_drafter(directory, policy.config, type(config))
