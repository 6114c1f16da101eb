"""Install like a user: the built wheel goes into a fresh venv that has the core dependencies
(torch, safetensors, nvidia-ml-py, numpy and what they need) and nothing else, so diffusers,
transformers and matplotlib are really absent. The CLI's entry points run from that venv:
``--help`` works, the subcommands that need the ``models`` extra print one line naming it and
exit 2, and those that do not need it run."""
import importlib.metadata as md
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_packaging import build_wheel

try:
    from packaging.requirements import Requirement
except ImportError:  # pip always carries a copy
    from pip._vendor.packaging.requirements import Requirement

CORE = ("torch", "safetensors", "nvidia-ml-py", "numpy")  # pyproject.toml's dependencies
EXTRA_LINE = "pip install 'weightstream[models]'"


def _closure(names) -> list[md.Distribution]:
    """The installed distributions ``names`` need, with their own requirements (no extras)."""
    seen: dict[str, md.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen[key] = dist = md.distribution(name)
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _core_site(folder: Path) -> Path:
    """A folder of links to the top-level entries (packages, modules, dist-info) of the core
    dependencies only: the fresh venv sees it through a .pth file."""
    folder.mkdir()
    for dist in _closure(CORE):
        root = Path(dist.locate_file(""))
        for top in {Path(f).parts[0] for f in dist.files or () if not str(f).startswith("..")}:
            if (root / top).exists() and not (folder / top).exists():
                (folder / top).symlink_to(root / top)
    return folder


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("install")
    wheel = build_wheel(tmp)
    env_dir = tmp / "venv"
    # without pip (and its setuptools, older than torch wants): this test's pip installs into it
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "weightstream-core-deps.pth").write_text(str(_core_site(tmp / "core")) + "\n")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-index",
                        "--disable-pip-version-check", str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]  # the core dependencies satisfy the wheel
    return env_dir, tmp


def _run(venv, *argv):
    env_dir, cwd = venv
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONNOUSERSITE="1", PATH=f"{env_dir / 'bin'}:{env.get('PATH', '')}")
    return subprocess.run(list(argv), cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_venv_has_no_extras(venv):
    code = ("import importlib.util as u, weightstream, sys\n"
            "assert 'site-packages' in weightstream.__file__, weightstream.__file__\n"
            "print([m for m in ('diffusers', 'transformers', 'matplotlib', 'peft') if u.find_spec(m)])")
    r = _run(venv, "python", "-c", code)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_help_runs(venv):
    r = _run(venv, "weightstream", "--help")
    assert r.returncode == 0 and "demo" in r.stdout and "plan" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("argv", [("demo", "--device", "cpu", "--steps", "1"),
                                  ("plan",),
                                  ("plan", "--model", "flux-12b", "--budget-gb", "16")])
def test_a_command_that_needs_diffusers_names_the_extra(venv, argv):
    r = _run(venv, "weightstream", *argv)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and EXTRA_LINE in lines[0] and "diffusers" in lines[0], r.stderr


@pytest.mark.parametrize("argv", [("demo", "--model", "toy", "--device", "cpu", "--steps", "1"),
                                  ("demo", "--mode", "module", "--device", "cpu")])
def test_commands_without_an_extra_run(venv, argv):
    r = _run(venv, "python", "-m", "weightstream", *argv)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "bit for bit" in r.stdout


def test_monitor_runs_without_matplotlib(venv):
    """The report extra only adds the PNG: without matplotlib monitor still writes trace and HTML."""
    out = venv[1] / "monitor-out"
    r = _run(venv, "weightstream", "monitor", "--out", str(out), "--no-live", "--", "python", "-c", "pass")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (out / "trace.json").is_file() and (out / "report.html").is_file()
    assert not (out / "report.png").exists()
