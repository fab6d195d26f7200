"""What every rollout engine provides to the driver, and the on-device loop they share.

An engine is a frozen dataclass used as the static `self` of its jitted functions:
  start(params, prompt_tokens, seqs, cache_length) -> state  (prefill; state has .seqs, .cache)
  step(params, state, seed_key) -> state                     (one policy forward per row)
  advance(params, state, seed_key, keep_going) -> state      (one iteration of the loop:
      a step by default; an engine that switches between kinds of step runs a segment of
      steps of one kind, while keep_going holds)
  row_stats(state) -> typed per-row statistics, or None
  summarize(responses) -> dict
`run` repeats `advance` in a `lax.while_loop` on device until every row is done or at most
`stop_at_active` rows still run, when the driver compacts the batch.
"""
import functools

import jax
import jax.numpy as jnp

from specroll_jax.rollout import response

# XLA:CPU's default copy insertion copies every loop-carried KV-cache layer twice per step
# (it cannot prove that the attention reads precede the commit's in-place write); its region
# analysis proves it. W3 at B=16: 189 -> 131 ms per decode step, identical outputs. It is
# an XLA:CPU option, so it is passed only when the program compiles for the CPU.
CPU_LOOP_COMPILER_OPTIONS = {'xla_cpu_copy_insertion_use_region_analysis': True}


def loop_compiler_options(backend: str) -> dict:
  """The compiler options of on-device loops compiled for `backend` ('cpu', 'gpu', 'tpu')."""
  return dict(CPU_LOOP_COMPILER_OPTIONS) if backend == 'cpu' else {}


def _run(engine, params, state, seed_key, stop_at_active):
  def keep_going(s):
    running = jnp.sum(~s.seqs.done)
    return (running > 0) & (running > stop_at_active)

  return jax.lax.while_loop(keep_going,
                            lambda s: engine.advance(params, s, seed_key, keep_going), state)


@functools.cache
def compiled_run(backend: str):
  """The jitted decode loop (`Engine.run`, the engine static) for `backend`. Export it for an
  accelerator with `jax.export.export(compiled_run('cpu'), platforms=[...])`: compiler
  options are not part of an exported module."""
  return jax.jit(_run, static_argnums=0, compiler_options=loop_compiler_options(backend))


class Engine:
  """Base of the vanilla and speculative engines (subclasses are frozen dataclasses)."""

  def run(self, params, state, seed_key, stop_at_active):
    return compiled_run(jax.default_backend())(self, params, state, seed_key, stop_at_active)

  def step(self, params, state, seed_key):
    raise NotImplementedError

  def advance(self, params, state, seed_key, keep_going):
    del keep_going
    return self.step(params, state, seed_key)

  def row_stats(self, state):
    del state
    return None

  def summarize(self, responses) -> dict:
    return response.summarize(responses)
