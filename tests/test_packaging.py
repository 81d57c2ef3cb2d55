"""The checkout as an import root: ``python -m pytest`` and the apps put it first on ``sys.path``."""

import importlib.metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_folder_of_the_checkout_hides_an_installed_distribution():
    # A top-level `kernels/` here once hid Hugging Face's `kernels`, which transformers imports when it
    # is installed: every test that built a transformers model failed to collect.
    importable = {p.stem for p in ROOT.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    installed = importlib.metadata.packages_distributions()
    hidden = {name: installed[name] for name in importable - {"nanostream"} if name in installed}
    assert not hidden, f"move these into nanostream/ (they hide installed packages): {hidden}"
