"""The rollout driver shared by every engine: buckets, segments and compaction.

An engine (rollout.engine.Engine) runs a bucket of rows on device until at most
`stop_at_active` are still running; the driver then moves the running rows into the next
smaller batch bucket (one host round trip per halving of the batch, never per token) so
finished rows stop costing compute.
"""
import dataclasses
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from specroll_jax.model.mesh import constrain_rows, put_rows, row_shards, to_host
from specroll_jax.rollout.buckets import batch_buckets, sequence_width
from specroll_jax.rollout.response import FINISH_EOS, FINISH_LENGTH, Response
from specroll_jax.rollout.sequences import Sequences


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Shape policy of a rollout. Batch buckets are row_shards * 2^k up to max_batch.

  Prompt widths are `buckets.prompt_bucket`s: powers of two by default, because a training
  run's prompt lengths change from call to call and every width compiles the whole decode
  loop again; a fixed prompt set (a benchmark) can afford finer widths and less padding.
  """
  max_new_tokens: int
  max_batch: int = 64
  # The smallest bucket compaction goes down to: every bucket is one more compiled loop, so
  # a measurement of one bucket (experiments.bench.drafts) keeps its rows there to the end.
  min_batch: int = 1
  prompt_bucket_min: int = 16
  prompt_buckets_per_octave: int = 1


@dataclasses.dataclass(frozen=True)
class Segment:
  """One on-device loop of a rollout: a bucket's rows run until the next bucket would hold
  them. Where a rollout's wall time goes as responses finish (the GRPO tail)."""
  batch: int        # the bucket's rows (running or not)
  running: int      # rows still running when the segment started
  seconds: float    # the loop and reading back which rows finished (no prefill, no gather)
  tokens: int       # tokens emitted in the segment
  row_steps: int    # engine steps of running rows (a row's forward, tree or plain)


def take_rows(tree, rows: jax.Array):
  """Gathers batch rows of a rollout state (every leaf, KV cache layers included, is row-major)."""
  return jax.tree.map(lambda node: node[rows], tree)


class Driver:
  """Runs a list of prompts x num_samples through an engine, bucket by bucket.

  With a mesh, rows are split over its row axes; across processes every process runs this
  same host program on the same prompts (its decisions read gathered copies of `done`),
  and each transfers only its own devices' rows.
  """

  def __init__(self, engine, config: RolloutConfig):
    self.engine = engine
    self.config = config
    self.buckets = [b for b in batch_buckets(config.max_batch, row_shards(engine.mesh))
                    if b >= min(config.min_batch, config.max_batch)]
    self._take_rows = jax.jit(partial(constrain_then_take, engine.mesh))

  def generate(self, params, prompts: list[list[int]], num_samples: int, seed: int,
               progress=None, segments: list | None = None) -> list[Response]:
    """Responses ordered by (prompt_index, sample_index); response id r = p * G + s.
    With `segments`, every on-device loop's Segment is appended to it."""
    prompt_width, cache_length = self._widths(prompts)
    seed_key = jax.random.key(seed)
    rows = [(p, s) for p in range(len(prompts)) for s in range(num_samples)]
    results = {}
    for start in range(0, len(rows), self.config.max_batch):
      chunk = list(range(start, min(start + self.config.max_batch, len(rows))))
      self._run_chunk(params, prompts, rows, chunk, num_samples, prompt_width, cache_length,
                      seed_key, results, progress, segments)
    return [results[r] for r in range(len(rows))]

  def first_state(self, params, prompts: list[list[int]], num_samples: int):
    """The engine state `generate` starts its first on-device loop from (after prefill),
    for profiling the loop on its own."""
    prompt_width, cache_length = self._widths(prompts)
    rows = [(p, s) for p in range(len(prompts)) for s in range(num_samples)]
    chunk = list(range(min(self.config.max_batch, len(rows))))
    state, _ = self._start_chunk(params, prompts, rows, chunk, prompt_width, cache_length)
    return state

  def _widths(self, prompts):
    """(prompt width, cache length) of every batch of `prompts`; checks the prompts."""
    if not prompts:
      raise ValueError('prompts is empty')
    for i, p in enumerate(prompts):
      if not len(p):
        raise ValueError(f'prompt {i} has no tokens')
    max_prompt = max(len(p) for p in prompts)
    limit = self.engine.model_config.max_position_embeddings
    if max_prompt + self.config.max_new_tokens > limit:
      worst = max(range(len(prompts)), key=lambda i: len(prompts[i]))
      raise ValueError(f'prompt {worst} has {max_prompt} tokens; with max_new_tokens='
                       f'{self.config.max_new_tokens} it exceeds the model\'s '
                       f'max_position_embeddings={limit}')
    cache_length = sequence_width(max_prompt, self.config.max_new_tokens,
                                  self.config.prompt_bucket_min,
                                  self.config.prompt_buckets_per_octave)
    return cache_length - self.config.max_new_tokens, cache_length

  def _start_chunk(self, params, prompts, rows, chunk, prompt_width, cache_length):
    """Prefills the rows `chunk` into the smallest bucket holding them: (state, the row of
    each slot, -1 for padding)."""
    batch = next(b for b in self.buckets if b >= len(chunk))
    tokens = np.zeros((batch, prompt_width), np.int32)
    lengths = np.ones((batch,), np.int32)
    response_ids = np.zeros((batch,), np.int32)
    for i, r in enumerate(chunk):
      prompt = prompts[rows[r][0]]
      tokens[i, :len(prompt)] = prompt
      lengths[i] = len(prompt)
      response_ids[i] = r
    padding = np.arange(batch) >= len(chunk)
    put = lambda array: put_rows(self.engine.mesh, array)
    seqs = Sequences.empty(put(response_ids), put(lengths),
                           put(np.full((batch,), self.config.max_new_tokens, np.int32)),
                           self.config.max_new_tokens, put(padding))
    state = self.engine.start(params, put(tokens), seqs, cache_length)
    return state, np.where(padding, -1, np.arange(batch) + chunk[0])

  def _run_chunk(self, params, prompts, rows, chunk, num_samples, prompt_width, cache_length,
                 seed_key, results, progress, segments):
    state, row_of_slot = self._start_chunk(params, prompts, rows, chunk, prompt_width,
                                           cache_length)
    batch = len(row_of_slot)
    generated = steps = np.zeros((batch,), np.int64)
    while True:
      smaller = [b for b in self.buckets if b < batch]
      stop_at = smaller[-1] if smaller else 0
      start = time.perf_counter()
      state = self.engine.run(params, state, seed_key, jnp.int32(stop_at))
      done = to_host(state.seqs.done)
      seconds = time.perf_counter() - start
      if segments is not None:
        now_generated, now_steps = to_host((state.seqs.num_generated, state.seqs.steps))
        segments.append(Segment(batch=batch, running=int(np.sum(row_of_slot >= 0)),
                                seconds=seconds,
                                tokens=int(np.sum(now_generated) - np.sum(generated)),
                                row_steps=int(np.sum(now_steps) - np.sum(steps))))
        generated, steps = now_generated, now_steps
      self._collect(state, done & (row_of_slot >= 0), row_of_slot, num_samples, results,
                    progress)
      row_of_slot = np.where(done, -1, row_of_slot)
      running = np.flatnonzero(row_of_slot >= 0)
      if not len(running):
        return
      # One bucket down at a time (a run that starts below its stop returns at once): the
      # compiled shapes are then one gather per bucket, whatever order rows finish in.
      batch = stop_at
      keep = np.concatenate([running, np.flatnonzero(row_of_slot < 0)])[:batch]
      state = self._take_rows(state, np.asarray(keep, np.int32))
      row_of_slot = row_of_slot[keep]
      generated, steps = generated[keep], steps[keep]

  def _collect(self, state, finished, row_of_slot, num_samples, results, progress):
    slots = np.flatnonzero(finished)
    if not len(slots):
      return
    seqs = state.seqs
    tokens, logprobs, counts, eos, steps, stats = to_host(
        (seqs.tokens, seqs.logprobs, seqs.num_generated, seqs.hit_eos, seqs.steps,
         self.engine.row_stats(state)))
    row = lambda slot: jax.tree.map(lambda x: x[slot], stats)
    for slot in slots:
      r = int(row_of_slot[slot])
      n = int(counts[slot])
      results[r] = Response(prompt_index=r // num_samples, sample_index=r % num_samples,
                            token_ids=tokens[slot, :n].tolist(),
                            logprobs=logprobs[slot, :n].tolist(),
                            finish_reason=FINISH_EOS if eos[slot] else FINISH_LENGTH,
                            steps=int(steps[slot]),
                            stats=row(slot))
    if progress is not None:
      progress.update(len(slots))


def constrain_then_take(mesh, state, rows):
  return constrain_rows(mesh, take_rows(state, rows))
