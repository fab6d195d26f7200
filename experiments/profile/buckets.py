"""Where one GRPO rollout's time goes, batch bucket by batch bucket, vanilla against SpecRoll.

  python -m experiments.profile.buckets --config=configs/bench_smol_paper.py --repeats=2

Builds the config's variant runs as the end-to-end benchmark does (experiments/lib/
variant_runs.py: the trainer's own rollouts, the gate priced on the first batch, the proposer
of c.proposer_dir placed), then generates the first GRPO step's rollout with each variant:
once to compile every bucket's loop, then --repeats times in alternation. The driver's
segments say how long each bucket ran and how many tokens and row steps it made; per bucket
the report gives each variant's median seconds and tokens per second, so a difference in a
whole step's generation time is found where it arises (gated plain steps against vanilla's
steps, tree steps, the buckets that only one engine visits).
"""
from absl import app, flags
from ml_collections import config_flags

from experiments.lib.bucket_times import report, summary, timed_rollouts
from experiments.lib.results import write
from experiments.lib.variant_runs import build_runs
from specroll_jax.rl.resources import restart_with_large_frees_returned

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/bench_smol_paper.py')
_REPEATS = flags.DEFINE_integer('repeats', 2, 'Timed rollouts per variant, after one that '
                                'compiles.', lower_bound=1)
_WORKDIR = flags.DEFINE_string('workdir', 'workdir/profile_buckets',
                               'Where the variant runs are built (cleared first).')
_OUT = flags.DEFINE_string('out_dir', 'results/smol_grpo_paper/buckets', 'Where results go.')


def main(argv):
  del argv
  c = _CONFIG.value
  if c.return_large_frees:
    restart_with_large_frees_returned()
  runs = build_runs(c, _WORKDIR.value)
  segments, summaries = timed_rollouts(runs, _REPEATS.value)
  prices = {v: [list(p) for p in getattr(run.rollouts.engine, 'tree_step_costs', ())]
            for v, (run, _) in runs.items()}
  write(report(c, summary(segments, summaries, prices)), _OUT.value)


if __name__ == '__main__':
  app.run(main)
