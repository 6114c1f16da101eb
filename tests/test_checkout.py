"""weightstream/checkout.py: a source checkout's folders never shadow installed packages."""
import importlib.metadata
import os
import subprocess
import sys

from weightstream.checkout import ROOT, is_checkout, root_last, safe_path


def test_root_last_moves_every_entry_of_the_root_to_the_end_once():
    other = os.path.dirname(os.__file__)
    path = [str(ROOT), other, "", str(ROOT / "tests"), str(ROOT) + "/"]
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)  # "" names the working folder: the root here
        assert is_checkout()
        assert root_last(path) == [other, str(ROOT / "tests"), str(ROOT)]
        assert root_last(path) == [other, str(ROOT / "tests"), str(ROOT)]  # idempotent
    finally:
        os.chdir(cwd)
    assert root_last([other]) == [other]  # nothing to move: unchanged


def test_safe_path_sets_pythonsafepath_inside_only():
    before = os.environ.get("PYTHONSAFEPATH")
    with safe_path():
        assert os.environ["PYTHONSAFEPATH"] == "1"
    assert os.environ.get("PYTHONSAFEPATH") == before


def _has_distribution(name: str) -> bool:
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def test_python_m_in_the_checkout_imports_the_installed_kernels_package():
    """`python -c` started in the checkout puts its root first; after root_last a top-level
    `import kernels` is the PyPI package (transformers >= 5.25 imports it whenever a diffusers
    model loads), or, where none is installed, our folder only as the last resort."""
    code = ("from weightstream.checkout import root_last; root_last(); import kernels, sys; "
            "print(getattr(kernels, '__file__', None))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    ours = str(ROOT / "kernels" / "__init__.py")
    if _has_distribution("kernels"):
        assert r.stdout.strip() != ours, r.stdout
    else:
        assert r.stdout.strip() == ours, r.stdout


def test_a_diffusers_model_loads_from_the_checkout_root():
    """From the checkout's root, after root_last, a diffusers transformer (and through it
    transformers) imports: it failed with an ImportError from our kernels/ folder before."""
    code = "from weightstream.checkout import root_last; root_last(); import diffusers.models.transformers.transformer_flux"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
