"""Engines side by side on one workload, in this process: the same prompts, seed and sampler;
each engine is compiled once, then timed `repeats` times in alternation, and ratios of
medians are reported (what bench_rollout and bench_group_drafts measure). Each engine's time
is also split by batch bucket (the driver's segments), so the GRPO tail, the last few rows
of a rollout, is measured on its own."""
import collections
import statistics
import time
from functools import partial

from specroll_jax.rollout.driver import Driver, RolloutConfig
from experiments.lib.common import left_padded
from experiments.lib.workloads import gated_engines, oracle_engine_params, workload_engines


def timed(fn, repeats):
  out, times = None, []
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - start)
  return out, times


def hf_generate_run(policy, prompts, samples, c):
  """transformers' generate on the same prompt ids and sampler, EOS on like our engines.

  Returns (run, generated token count of the last run)."""
  import torch
  import transformers
  torch.set_num_threads(c.hf_threads)
  hf = transformers.AutoModelForCausalLM.from_pretrained(c.checkpoint,
                                                           dtype=getattr(torch, c.dtype))
  hf.eval()
  eos = list(policy.eos_ids)
  batch = left_padded(prompts, 0)  # the attention mask hides the pad id
  width = batch['input_ids'].shape[1]
  counted = {}

  def run():
    with torch.no_grad():
      out = hf.generate(**batch, do_sample=True,
                        temperature=c.temperature, top_k=0, top_p=1.0,
                        max_new_tokens=c.max_new_tokens, num_return_sequences=samples,
                        eos_token_id=eos, pad_token_id=eos[0])[:, width:]
    # A row's tokens are those up to and including its first EOS.
    is_eos = torch.isin(out, torch.tensor(eos))
    after_eos = (torch.cumsum(is_eos.long(), dim=1) - is_eos.long()) > 0
    counted['tokens'] = int((~after_eos).sum())
    return out

  return run, counted


def by_bucket(engine, segments, repeats: int) -> dict:
  """{batch: its share of the engine's decode time, seconds per run, tokens per second, tau
  (tokens per row step), and for a speculative engine the tree width and the price its gate
  holds there}, from the Segments of `repeats` runs. A bucket's rows and tokens are the same
  for every engine up to where inside a step a row crosses the bucket's boundary, so
  per-bucket speedups compare tokens per second."""
  totals = collections.defaultdict(collections.Counter)
  for s in segments:
    totals[s.batch].update(seconds=s.seconds, tokens=s.tokens, row_steps=s.row_steps)
  decode_seconds = sum(t['seconds'] for t in totals.values())
  out = {}
  for batch, t in sorted(totals.items()):
    out[batch] = dict(share=t['seconds'] / decode_seconds, seconds=t['seconds'] / repeats,
                      tokens_per_s=t['tokens'] / t['seconds'] if t['seconds'] else 0.0,
                      tau=t['tokens'] / max(t['row_steps'], 1))
    if hasattr(engine, 'tree_width'):
      out[batch].update(width=engine.tree_width(batch), price=engine.tree_step_cost(batch))
  return out


def compare(policy, drafts, prompts, samples, c, tree, sampler, prices,
            names=('vanilla', 'specroll', 'oracle')):
  """One side-by-side run of the engines `names` (workloads.ENGINE_NAMES, vanilla first) on
  `prompts` x `samples`; with c.speculation_gate the speculative engines' gates are priced
  from `prices` (measured when missing), and with c.size_trees their widths sized."""
  rollout = RolloutConfig(c.max_new_tokens, max_batch=len(prompts) * samples,
                          prompt_buckets_per_octave=c.prompt_buckets_per_octave)
  engines = workload_engines(policy, drafts, c, tree, sampler, names)
  reference = Driver(engines['vanilla'], rollout).generate(policy.params, prompts, samples,
                                                           c.seed)  # also compiles
  params = {name: engine.params(policy.params, drafts.params) for name, engine in engines.items()
            if name not in ('vanilla', 'oracle')}
  params['vanilla'] = policy.params
  if 'oracle' in engines:
    params['oracle'] = oracle_engine_params(engines['oracle'], policy, reference,
                                            c.max_new_tokens)
  if c.speculation_gate:
    engines = gated_engines(engines, params, rollout, prompts, samples, prices,
                            size_widths=c.size_trees)
  drivers = {name: Driver(engine, rollout) for name, engine in engines.items()}
  segments = {name: [] for name in engines}  # of the timed runs
  runs = {name: partial(drivers[name].generate, params[name], prompts, samples, c.seed)
          for name in engines}
  if c.hf_generate:
    runs['hf_generate'], hf_tokens = hf_generate_run(policy, prompts, samples, c)
  for run in runs.values():
    run()  # compile every shape this workload reaches
  times = {name: [] for name in runs}
  outputs = {}
  for _ in range(c.repeats):
    for name, run in runs.items():
      timed_run = partial(run, segments=segments[name]) if name in segments else run
      outputs[name], t = timed(timed_run, 1)
      times[name] += t
  result = {}
  for name in engines:
    same = [a.token_ids == b.token_ids for a, b in zip(outputs[name], reference)]
    tokens_same = sum(len(a.token_ids) for a, s in zip(reference, same) if s)
    result[name] = dict(engines[name].summarize(outputs[name]), seconds=times[name],
                        median_seconds=statistics.median(times[name]),
                        identical_fraction=tokens_same / sum(len(a.token_ids) for a in reference),
                        identical_responses=sum(same))
  for name in engines:
    result[name]['speedup'] = result['vanilla']['median_seconds'] / result[name]['median_seconds']
    result[name]['tokens_per_s'] = (sum(len(r.token_ids) for r in outputs[name])
                                    / result[name]['median_seconds'])
    result[name]['buckets'] = by_bucket(engines[name], segments[name], c.repeats)
  for name in engines:
    for batch, bucket in result[name]['buckets'].items():
      vanilla = result['vanilla']['buckets'].get(batch)
      bucket['speedup'] = (bucket['tokens_per_s'] / vanilla['tokens_per_s']
                           if vanilla and vanilla['tokens_per_s'] else None)
  if c.hf_generate:
    seconds = statistics.median(times['hf_generate'])
    result['hf_generate'] = dict(seconds=times['hf_generate'], median_seconds=seconds,
                                 tokens=hf_tokens['tokens'],
                                 tokens_per_s=hf_tokens['tokens'] / seconds)
    result['vanilla']['vs_hf_generate'] = (result['vanilla']['tokens_per_s']
                                           / result['hf_generate']['tokens_per_s'])
  return result
