"""GRPO runs of one benchmark config, one per rollout variant, each from step 0 in its own
workdir: 'vanilla' (first, the baseline), 'specroll' with the job's adaptation mode, or
'specroll:MODE' with another. What the end-to-end benchmark steps in turn and the rollout
profile times side by side."""
import shutil
from pathlib import Path

from experiments.lib.common import clear_run, trainer_part
from specroll_jax.rl.learned_proposers import KINDS
from specroll_jax.rl.run import make_run
from specroll_jax.rl.run_config import run_config

BASELINE = 'vanilla'


def variant_config(c, variant: str):
  """The typed run config of `variant` ('vanilla', 'specroll' or 'specroll:MODE')."""
  engine, _, mode = variant.partition(':')
  run = trainer_part(c)
  run.rollout.engine = engine
  if mode:
    if engine != 'specroll':
      raise ValueError(f'config variants: {variant!r}: only specroll variants take an '
                       'adaptation mode')
    run.adaptation.mode = mode
  return run_config(run)


def checked_variants(c) -> dict:
  """Every variant's typed config, all checked before any run is built (minutes each)."""
  variants = tuple(c.variants)
  if len(variants) < 2 or variants[0] != BASELINE or len(set(variants)) != len(variants):
    raise ValueError(f'config variants must start with {BASELINE!r} and name at least one '
                     f'other, each once, got {variants}')
  return {variant: variant_config(c, variant) for variant in variants}


def place_proposer(c, config, workdir: Path) -> None:
  """Copies the learned proposer trained beforehand (c.proposer_dir) to where the run's warm
  start finds it, for the variants that draft with one."""
  learned = config.rollout.learned_proposer
  if not c.proposer_dir or learned is None:
    return
  kind, source = KINDS[learned], Path(c.proposer_dir)
  if not kind.is_saved(source):
    raise FileNotFoundError(f'config proposer_dir: {source} holds no saved {learned}')
  shutil.copytree(source, workdir / kind.directory_name, dirs_exist_ok=True)


def build_runs(c, workdir) -> dict:
  """Every variant's (run, starting state), from step 0 in a fresh `workdir`/<variant>."""
  runs = {}
  for variant, config in checked_variants(c).items():
    variant_dir = Path(workdir) / variant.replace(':', '_')
    clear_run(variant_dir)
    place_proposer(c, config, variant_dir)
    runs[variant] = make_run(config, variant_dir)
  return runs
