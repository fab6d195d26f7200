"""The notebooks run top to bottom (so they never rot)."""
import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import REPO

NOTEBOOKS = sorted((REPO / 'experiments' / 'notebooks').glob('*.ipynb'))


@pytest.mark.parametrize('path', NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
@pytest.mark.slow
def test_notebook_executes(path, monkeypatch):
  # The kernel sees one host device, as a user's one-CPU session does (the suite forces 8,
  # and configs/tiny_math.py's mesh would split rows over all of them).
  monkeypatch.setenv('XLA_FLAGS', '')
  # Every cell, at the smaller sizes a notebook offers for this run.
  monkeypatch.setenv('SPECROLL_NOTEBOOK_QUICK', '1')
  notebook = nbformat.read(path, as_version=4)
  NotebookClient(notebook, timeout=900, kernel_name='python3',
                 resources={'metadata': {'path': str(path.parent)}}).execute()
