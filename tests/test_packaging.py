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


MAX_LINES = 300


def test_every_module_of_the_package_stays_small_enough_to_read_at_once():
    # The style's rule (shared/style.md: one concept per file): a file past it is split by what each part does.
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "nanostream").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these by what each part does (at most {MAX_LINES} lines a file): {long}"
