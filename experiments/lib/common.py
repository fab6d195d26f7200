"""Paths and file helpers shared by the experiment entry points (no flags defined here)."""
import dataclasses
import json
import shutil
from pathlib import Path

from specroll_jax.rl.report import TIME_KEYS
from specroll_jax.rl.metrics import METRICS_FILE
from specroll_jax.rl.run import STEP_COSTS_FILE
from specroll_jax.rl.run_config import RunConfig
from specroll_jax.rl.trainer import train
from specroll_jax.tasks.paths import STORIES260K_DIR

DEFAULT_CHECKPOINT = STORIES260K_DIR


def read_prompts(path: Path) -> list[str]:
  """Reads {"prompt": "..."} lines; errors name the file and line."""
  if not path.is_file():
    raise FileNotFoundError(f'{path}: prompts file not found')
  prompts = []
  for number, line in enumerate(path.read_text().splitlines(), 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f'{path}:{number}: not valid JSON ({e})') from None
    if not isinstance(row, dict) or not isinstance(row.get('prompt'), str):
      raise ValueError(f'{path}:{number}: expected an object with a string field "prompt"')
    prompts.append(row['prompt'])
  if not prompts:
    raise ValueError(f'{path}: no prompts')
  return prompts


def write_jsonl_atomic(path: Path, rows) -> None:
  """Writes rows to a temporary file first so an interruption never leaves half a file."""
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(path.suffix + '.tmp')
  with tmp.open('w') as f:
    for row in rows:
      f.write(json.dumps(row) + '\n')
  tmp.replace(path)


def trainer_part(c):
  """The trainer's sections of a benchmark config, which adds its own top-level keys
  (out_dir, variants, ...) to a training config: what `train` checks, strictly."""
  part = c.copy_and_resolve_references()
  part.unlock()  # absl's --config flag hands over a locked config
  trainer_keys = {f.name for f in dataclasses.fields(RunConfig)}
  for key in [k for k in part.keys() if k not in trainer_keys]:
    del part[key]
  return part


def clear_run(workdir: Path) -> None:
  """Removes a run's checkpoints, metrics and gate prices from `workdir` (cached warm
  starts kept), so the next run there starts from step 0."""
  shutil.rmtree(workdir / 'checkpoints', ignore_errors=True)
  (workdir / METRICS_FILE).unlink(missing_ok=True)
  # The gate's prices belong to the run: a fresh run measures its own.
  (workdir / STEP_COSTS_FILE).unlink(missing_ok=True)


def run_fresh(run, workdir: Path) -> list[dict]:
  """Trains the benchmark config `run` from step 0 in `workdir` (cached heads kept);
  returns its metrics."""
  clear_run(workdir)
  train(trainer_part(run), workdir)
  return [json.loads(l) for l in (workdir / METRICS_FILE).read_text().splitlines() if l]


def totals(rows, warmup: int = 1) -> dict:
  """Seconds per timed phase summed over the steps after `warmup` (the first step compiles
  most shapes; first_step reports it). A phase a step did not run (the audit between its
  due steps) counts 0."""
  steady = rows[warmup:]
  out = {k: sum(r.get(f'time_{k}', 0.0) for r in steady) for k in TIME_KEYS}
  out['end_to_end'] = sum(out.values())
  out['first_step'] = sum(rows[0].get(f'time_{k}', 0.0) for k in TIME_KEYS)
  return out


def left_padded(prompts: list[list[int]], pad_id: int) -> dict:
  """Prompt ids as transformers' `generate` takes them: left-padded torch tensors with the
  attention mask that hides the padding (torch is imported here only: the one-off tools
  that compare against transformers need it, the package does not)."""
  import torch
  width = max(len(p) for p in prompts)
  ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
  mask = torch.zeros((len(prompts), width), dtype=torch.long)
  for i, p in enumerate(prompts):
    ids[i, width - len(p):] = torch.tensor(p)
    mask[i, width - len(p):] = 1
  return {'input_ids': ids, 'attention_mask': mask}
