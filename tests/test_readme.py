"""Every ```python block of README.md runs on the CPU (issue 16).

Names a snippet uses without defining them are the reader's own objects; the
test provides real ones: ``transformer``/``dit`` a tiny Flux model and
``same_kwargs_as_before`` its inputs, ``pipe`` a small pipeline, ``rank`` 0 of
a one-process gloo group. ``"cuda..."`` device strings become ``"cpu"``.
Every ``python -m weightstream`` line of the bash blocks must parse.
"""
import os
import re
import shlex

import pytest
import torch
import torch.distributed as dist

from weightstream.__main__ import _parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)
BASH_BLOCKS = re.findall(r"```bash\n(.*?)```", README, re.S)


def _on_cpu(code: str) -> str:
    code = re.sub(r'f?"cuda(:[^"]*)?"', '"cpu"', code)
    return code


def _namespace() -> dict:
    from weightstream.demo_module import DeclaredToyPipeline
    from weightstream.models import flux_inputs, tiny_flux

    model = tiny_flux()
    return {"transformer": model, "dit": tiny_flux(), "same_kwargs_as_before": flux_inputs(model, device="cpu"),
            "pipe": DeclaredToyPipeline(), "rank": 0}


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_readme_has_python_blocks():
    assert len(PYTHON_BLOCKS) >= 4


@pytest.mark.parametrize("i", range(len(PYTHON_BLOCKS)))
def test_python_block_runs(i, one_rank_group):
    code = _on_cpu(PYTHON_BLOCKS[i]).replace("\n    ...\n", "\n    pass\n")
    with torch.no_grad():
        exec(compile(code, f"README.md python block {i}", "exec"), _namespace())


def _cli_lines():
    for block in BASH_BLOCKS:
        for line in block.splitlines():
            line = line.split("#")[0].strip()
            if "-m weightstream " in line and "torchrun" not in line:
                yield line.split("-m weightstream ", 1)[1]


@pytest.mark.parametrize("line", list(_cli_lines()))
def test_cli_lines_parse(line):
    argv = shlex.split(line)
    if argv[0] in ("bench", "monitor"):
        assert argv[0] in _parser().format_help()
        return
    argv = [a for a in argv if not (a.startswith("[") or a.endswith("]"))]  # optional-argument notation
    _parser().parse_args(argv)
