"""Every shipped config loads and is consistent with what the trainer will build."""
import dataclasses

import pytest

from configs import (bench_smol_paper, bench_w1, bench_w2, bench_w3, bench_w4, drafts_w3,
                     group_drafts, paper, smol_grpo, smol_grpo_paper, tiny_math)
from configs.tiny_math import get_config
from specroll_jax.rl.run_config import run_config
from specroll_jax.rl.trainer import train
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.tasks.data import load_dataset
from experiments.lib.common import trainer_part
from experiments.lib.workloads import ENGINE_NAMES, drafter_config, warm_started_drafts
from tests.conftest import FIXTURE_DATA

PAPER_ARGS = [f'{m},{d}' for m in paper.MODELS for d in paper.DATASETS]


@pytest.mark.parametrize('config', [tiny_math.get_config(), smol_grpo.get_config(),
                                    smol_grpo_paper.get_config()] +
                         [paper.get_config(a) for a in PAPER_ARGS],
                         ids=['tiny_math', 'smol_grpo', 'smol_grpo_paper'] + PAPER_ARGS)
def test_training_configs_are_consistent(config):
  rows = config.rollout.prompts_per_step * config.rollout.group_size
  assert rows % config.grpo.micro_batch_size == 0
  assert config.rollout.driver.max_batch % 8 == 0
  run_config(config)  # every section builds its dataclass: clip ranges, lr, modes, ...
  if not config.task.source.startswith('synthetic:'):
    assert load_dataset(config.task.source, FIXTURE_DATA).examples


def test_bad_sections_fail_before_any_policy_is_loaded(tmp_path):
  c = get_config()
  c.policy.checkpoint = str(tmp_path / 'nowhere')  # loading it would fail differently
  c.adaptation.mode = 'sometimes'
  with pytest.raises(ValueError, match='adaptation.mode must be one of'):
    train(c, tmp_path / 'run')
  c = get_config()
  c.adaptation.reflex.step_sise = 2.0
  with pytest.raises(ValueError, match=r"adaptation.reflex: unknown field\(s\) \['step_sise'\]"):
    run_config(c)
  c = get_config()
  c.task.reward = 'loose'
  with pytest.raises(ValueError, match="task.reward must be one of"):
    run_config(c)
  c = get_config()
  c.evaluation.samples = 0
  with pytest.raises(ValueError, match='evaluation: every must be >= 0'):
    run_config(c)
  c = get_config()
  c.grpo.clip_epsilon_low = 1.5
  with pytest.raises(ValueError, match='clip_epsilon_low must be in'):
    run_config(c)
  c = get_config()
  c.stpes = 3
  with pytest.raises(ValueError, match=r"config \(top level\): unknown field\(s\) \['stpes'\]"):
    run_config(c)


def test_run_config_is_typed_and_benchmarks_hand_the_trainer_its_part():
  config = run_config(get_config())
  assert isinstance(config.rollout.sampler, SamplerConfig)
  assert config.grpo.group_size == config.rollout.group_size  # derived once, at the edge
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.rollout.engine = 'vanilla'
  for module in (bench_w1, bench_smol_paper):
    bench = module.get_config()
    bench.lock()  # as absl's --config flag hands it over
    assert bench.out_dir and run_config(trainer_part(bench)).steps == bench.steps


def test_paper_config_rejects_unknown_names():
  with pytest.raises(ValueError, match='choose MODEL'):
    paper.get_config('gpt2,gsm8k')


@pytest.mark.parametrize('module', [bench_w2, bench_w3, bench_w4])
def test_bench_config_loads(module):
  c = module.get_config()
  assert c.num_prompts * c.samples_per_prompt in c.batch_sweep
  assert len(c.branching) <= c.heads.num_heads


def test_proposers_are_checked_before_any_policy_is_loaded():
  c = get_config()
  assert c.rollout.proposers == 'heads,group'  # group drafts are on in the GRPO default
  c.rollout.proposers = 'heads,suffix'
  with pytest.raises(ValueError, match="subset of heads, drafter, context_drafter, group"):
    run_config(c)
  c = get_config()
  c.rollout.proposers = 'group'  # no heads to adapt
  with pytest.raises(ValueError, match="adapts heads or a drafter"):
    run_config(c)
  c.rollout.proposers = 'heads,drafter,group'
  with pytest.raises(ValueError, match="one learned proposer per rollout"):
    run_config(c)
  c.rollout.proposers = 'drafter,context_drafter'
  with pytest.raises(ValueError, match="one learned proposer per rollout"):
    run_config(c)
  c.rollout.proposers = 'context_drafter,group'
  run_config(c)  # the slow path adapts the context drafter's layer
  c.rollout.proposers = 'drafter,group'
  run_config(c)  # the slow path adapts the drafter's block
  c.adaptation.mode = 'both'
  with pytest.raises(ValueError, match="does not apply to the drafter"):
    run_config(c)
  c.adaptation.mode = 'slow'
  c.drafter.expanded = (2, 2, 2)
  run_config(c)  # each row's two best paths expanded per depth of the spine (4, 2, 2, 1)
  c.drafter.expanded = (2, 5, 1)  # depth 2 has 2 x 2 candidates, not 5
  with pytest.raises(ValueError, match=r"drafter.expanded: expanded=\(2, 5, 1\)"):
    run_config(c)
  c.drafter.expanded = ()
  c.drafter.model.feature_layers = (2, 15)
  run_config(c)  # its warm start's and harvests' pairs carry layers 2 and 15 beside h_t
  c.rollout.proposers = 'context_drafter,group'
  run_config(c)  # the context kind fuses them the same way
  c.drafter.context_heads = 0
  with pytest.raises(ValueError, match=r"config drafter.model: ContextDrafterConfig: "
                                       r"num_heads >= 1"):
    run_config(c)
  c.drafter.context_heads = 4
  c.rollout.proposers = 'drafter,group'
  c.drafter.model.feature_layers = ()
  c.drafter.branching = (2, 2, 2, 2, 2)
  with pytest.raises(ValueError, match=r"drafter.branching=.*at most drafter.model.depth=4"):
    run_config(c)
  c.rollout.proposers = 'group'
  c.adaptation.mode = 'static'
  run_config(c)
  c.rollout.group.min_match = 0
  with pytest.raises(ValueError, match='min_match must be >= 1'):
    run_config(c)


def test_drafts_config_builds_its_proposers_and_cells():
  c = drafts_w3.get_config()
  assert c.drafts == 'heads'  # bench_w3's default; bench_drafts runs both proposers itself
  assert set(c.proposers) <= {'heads', 'drafter', 'drafter_tree', 'heads_group', 'drafter_group',
                              'oracle'}
  assert len(c.drafter_branching) <= c.drafter.depth
  assert {tuple(cell) for cell in c.greedy_cells} <= {(n, r) for n in c.budgets
                                                      for r in c.responses}
  drafter_config(c.drafter)  # the section is a valid DrafterConfig
  c.drafts = 'medusa'
  with pytest.raises(ValueError, match="drafts must be 'heads' or 'drafter'"):
    warm_started_drafts(None, c)


def test_group_drafts_config_names_known_engines():
  c = group_drafts.get_config()
  assert set(c.engines) <= set(ENGINE_NAMES)
  for workload in c.workloads.values():
    assert len(workload.branching) <= workload.heads.num_heads
