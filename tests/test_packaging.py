"""The built wheel carries every module of the package (a subpackage missing from
pyproject's package list would import in an editable checkout and fail when installed)."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLDERS = {"weightstream": "weightstream", "offload": "weightstream/offload", "kernels": "weightstream/kernels",
           "graphs": "weightstream/graphs"}


def build_wheel(tmp_path: Path) -> Path:
    """Build the wheel from a clean copy of the checkout (no build/ leftovers); return its path."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    for folder in FOLDERS:
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path)], cwd=src, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return next(tmp_path.glob("weightstream-*.whl"))


def test_wheel_has_every_module(tmp_path):
    wheel = build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {f"{dst}/{p.relative_to(REPO / src).as_posix()}"
            for src, dst in FOLDERS.items() for p in (REPO / src).rglob("*.py")}
    missing = sorted(want - names)
    assert not missing, f"modules missing from the wheel: {missing}"
    assert "weightstream/py.typed" in names
