"""The learned-proposer registry: every kind implements the whole interface, and the run's
proposer, adaptation state and memory part come from it for any kind (stories260K, fresh
parameters in place of a warm start, which the trainer tests run)."""
import jax
import numpy as np
import pytest

from configs.tiny_math import get_config
from specroll_jax.adapt import distill
from specroll_jax.model.mesh import MeshConfig, make_mesh
from specroll_jax.rl.adaptation import ProposerState, WarmStarted
from specroll_jax.rl.learned_proposers import KINDS, PROPOSERS, parse_proposers, saved_kind_name
from specroll_jax.rl.rollouts import make_proposer
from specroll_jax.rl.run_config import run_config
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.drafter import FEATURES, init_drafter, save_drafter
from specroll_jax.speculative.group_proposer import GroupProposer
from specroll_jax.speculative.heads import init_heads, save_heads


def _config(kind: str, mode: str):
  c = get_config()
  c.rollout.proposers, c.adaptation.mode, c.mesh.data = f'{kind},group', mode, 1
  return run_config(c)


def _fresh(kind: str, config, policy, directory) -> WarmStarted:
  """Fresh parameters, saved where a warm start caches them (without its metadata)."""
  static = KINDS[kind].static_config(config)
  if kind == 'heads':
    params = init_heads(static, policy.config)
    save_heads(directory, static, params)
  else:
    params = init_drafter(static, policy.config, np.arange(policy.config.vocab_size))
    save_drafter(directory, static, params)
  return WarmStarted(static, params, directory)


def test_the_registry_names_every_kind_and_group_drafts():
  assert PROPOSERS == (*KINDS, 'group')
  for kind in KINDS:
    assert parse_proposers(f'{kind},group') == (kind, 'group')


@pytest.mark.parametrize('kind', sorted(KINDS))
def test_each_kind_builds_the_runs_proposer_state_and_memory(kind, stories_policy, tmp_path):
  config = _config(kind, 'slow')
  warm = _fresh(kind, config, stories_policy, tmp_path)
  proposer = make_proposer(stories_policy, config, warm)
  assert isinstance(proposer, GroupProposer)  # merged with group drafts, as configured
  adaptation = KINDS[kind].adaptation(stories_policy, config, warm, proposer)
  state = adaptation.init_state(warm.params, make_mesh(MeshConfig(data=1)))
  assert isinstance(state, ProposerState)
  assert adaptation.harvests and len(adaptation.branching) >= 1
  part = KINDS[kind].memory(stories_policy.config, warm.config)
  assert part.label and part.copies == 3


@pytest.mark.parametrize('kind', sorted(KINDS))
def test_reflex_is_offered_only_where_a_kind_supports_it(kind):
  if KINDS[kind].supports_reflex:
    assert _config(kind, 'both').adaptation.mode == 'both'
  else:
    with pytest.raises(ValueError, match=f'does not apply to the {kind}'):
      _config(kind, 'both')


@pytest.mark.parametrize('kind', sorted(KINDS))
def test_a_saved_proposer_is_found_loaded_and_drafts_by_its_kind(kind, stories_policy,
                                                                  tmp_path):
  warm = _fresh(kind, _config(kind, 'static'), stories_policy, tmp_path)
  assert saved_kind_name(tmp_path) == kind
  loaded = KINDS[kind].load(stories_policy, tmp_path)
  assert loaded.config == warm.config
  for saved, read in zip(jax.tree.leaves(warm.params), jax.tree.leaves(loaded.params)):
    np.testing.assert_array_equal(np.asarray(saved), np.asarray(read))
  proposer = KINDS[kind].drafting(stories_policy, loaded, SamplerConfig(), (2, 1))
  assert proposer.depth == 2


@pytest.mark.parametrize('kind', ['drafter', 'context_drafter'])
def test_a_run_s_drafter_reading_layer_features_gets_them_in_rollouts_and_pairs(
    stories_policy, tmp_path, kind):
  """drafter.model.feature_layers, for either drafter kind: the run's proposer asks the
  engine for those layers (the learner harvests them too: run.py), its warm start has a
  fusion, and the warm start's pairs carry them beside h_t, whose part and targets are the
  plain pairs' bit for bit."""
  policy = stories_policy
  c = get_config()
  c.rollout.proposers, c.adaptation.mode, c.mesh.data = f'{kind},group', 'slow', 1
  c.drafter.model.feature_layers = (0,)
  warm = _fresh(kind, run_config(c), policy, tmp_path)
  assert FEATURES in warm.params.weights
  assert make_proposer(policy, run_config(c), warm).feature_layers == (0,)
  rows = [[1, 5, 9, 11, 40], [1, 7]]
  wide = distill.build_batch(policy.config, policy.params, rows, 6, 4, feature_layers=(0,))
  plain = distill.build_batch(policy.config, policy.params, rows, 6, 4)
  dim = policy.config.hidden_size
  assert wide.hidden.shape[-1] == 2 * dim
  np.testing.assert_array_equal(np.asarray(wide.hidden[..., :dim]), np.asarray(plain.hidden))
  for name in ('target_ids', 'target_logp', 'tokens', 'valid'):
    np.testing.assert_array_equal(np.asarray(getattr(wide, name)),
                                  np.asarray(getattr(plain, name)))


def test_a_directory_without_a_saved_proposer_is_an_error_naming_it(tmp_path):
  with pytest.raises(ValueError, match=f'{tmp_path}: expected one saved learned proposer'):
    saved_kind_name(tmp_path)
