"""The learned proposers a run can draft with, by name: the only place that lists them.

`rollout.proposers` names at most one of them, optionally with 'group' (continuations found
in the GRPO group, speculative/group_proposer.py), merged into one tree. A new kind is one
file implementing `rl.adaptation.LearnedProposerKind`, one entry here, and its test.
"""
from specroll_jax.rl.adaptation import LearnedProposerKind
from specroll_jax.rl.drafter_adaptation import ContextDrafterKind, DrafterKind
from specroll_jax.rl.head_adaptation import HeadsKind

KINDS: dict[str, LearnedProposerKind] = {'heads': HeadsKind(), 'drafter': DrafterKind(),
                                         'context_drafter': ContextDrafterKind()}
GROUP = 'group'
PROPOSERS = (*KINDS, GROUP)


def parse_proposers(names: str) -> tuple:
  """'heads', 'drafter', 'context_drafter', 'group', 'heads,group', ... -> PROPOSERS names,
  each once, with at most one learned kind."""
  chosen = tuple(n.strip() for n in names.split(',') if n.strip())
  unknown = [n for n in chosen if n not in PROPOSERS]
  if not chosen or unknown or len(set(chosen)) != len(chosen):
    raise ValueError(f'proposers must be a comma-separated subset of {", ".join(PROPOSERS)}, '
                     f'each once; got {names!r}')
  if len([n for n in chosen if n in KINDS]) > 1:
    raise ValueError(f'proposers {names!r}: one learned proposer per rollout, '
                     f'{" or ".join(KINDS)} (their trees would compete for the same nodes)')
  return chosen


def saved_kind_name(directory) -> str:
  """The kind of learned proposer saved in `directory`."""
  found = [name for name, kind in KINDS.items() if kind.is_saved(directory)]
  if len(found) != 1:
    raise ValueError(f'{directory}: expected one saved learned proposer ({", ".join(KINDS)}), '
                     f'found {found or "none"}')
  return found[0]


def learned_kind_name(names: tuple) -> str | None:
  """The learned kind among parsed `names`, or None (group drafts alone)."""
  return next((n for n in names if n in KINDS), None)
