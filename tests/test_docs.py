"""README.md and docs/*.md are part of the product (issue 35); these tests keep them true.

1. docs/configuration.md has a row for every OffloadConfig / LayerOptions field with its default,
   and names every allowed value and legacy vLLM-Omni flag (all read from offload/config.py); each of
   its JSON blocks is a valid config.
2. Every ```python block of README.md and docs/*.md runs on the CPU. Names a block uses without
   defining them are the reader's own objects; the test provides real ones: ``transformer`` / ``dit``
   a tiny Flux model and ``same_kwargs_as_before`` its inputs, ``pipe`` a small pipeline,
   ``checkpoint_dir`` a diffusers folder of that Flux model's safetensors, ``rank`` 0 of a
   one-process gloo group. ``"cuda..."`` device strings become ``"cpu"``. A block that needs a GPU
   or a download is fenced ```python no-run equivalent=<tests/file.py>::<test>: that test must exist,
   and there are at most NO_RUN_BUDGET such blocks. The README quickstart's equivalent runs here, on
   a tiny FluxPipeline built from configs.
3. Every relative link (and #anchor) points to an existing file and heading; the index links every
   page.
4. README.md: at most 150 lines / 12000 bytes, "make demo" and "make test", at most 8 result rows,
   commit hashes only in its one footnote.
5. docs/errors.md names every ``class ...Error`` of the product code.
6. Every ``python -m weightstream`` line of a bash block parses.
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import json
import re
import shlex
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tiny_pipelines import generate, tiny_flux_pipeline
from weightstream.__main__ import _parser
from weightstream.offload import config_schema as schema
from weightstream.offload.codecs import WEIGHT_CODECS
from weightstream.offload.config import LayerOptions, OffloadConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [README] + sorted(DOCS.glob("*.md"))
PRODUCT = ("offload", "kernels", "graphs", "weightstream")
NO_RUN_BUDGET = 3  # blocks that cannot run on a CPU without a download: keep them few
PENDING = {"docs/performance.md"}  # written by another change; a link to it is accepted while it is missing
FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```[ \t]*$", re.S | re.M)
NO_RUN = re.compile(r"^ no-run equivalent=(tests/[\w/]+\.py)::(\w+)$")
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def _rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _fences(page: Path, lang: str) -> list[tuple[str, str, str]]:
    """(id, info string after the language, code) of every ``lang`` block of ``page``."""
    found = [m for m in FENCE.finditer(page.read_text()) if m.group(1) == lang]
    return [(f"{_rel(page)} {lang} block {i}", m.group(2), m.group(3)) for i, m in enumerate(found)]


def _python_blocks():
    return [b for page in PAGES for b in _fences(page, "python")]


RUN = [(bid, code) for bid, info, code in _python_blocks() if not info.strip()]
NOT_RUN = [(bid, info, code) for bid, info, code in _python_blocks() if info.strip()]


def _prose(page: Path) -> str:
    """The page without its fenced blocks (links and headings of the prose only)."""
    return FENCE.sub("", page.read_text())


# ------------------------------------------------------------------ 1. configuration

def _row(text: str, key: str) -> str | None:
    m = re.search(rf"^\| `{re.escape(key)}` \| ([^|]*(?:\\\|[^|]*)*) \|", text, re.M)
    return None if m is None else m.group(1)


def _default_token(name: str, default) -> str:
    if name in ("mode", "components"):
        return "(required)"
    if name == "layer_options":
        return "(`{}`)"
    if default is None:
        return "(null"
    if isinstance(default, bool):
        return f"({str(default).lower()})"
    if isinstance(default, str):
        return f"(`{default}`)"
    return f"({default:g})"


def _fields_with_defaults(cls, prefix: str = ""):
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        yield prefix + f.name, f.name, default


def test_configuration_has_a_row_with_the_default_of_every_field():
    text = (DOCS / "configuration.md").read_text()
    fields = list(_fields_with_defaults(OffloadConfig)) + list(
        _fields_with_defaults(LayerOptions, "layer_options.<component>."))
    problems = []
    for key, name, default in fields:
        cell = _row(text, key)
        want = _default_token(name, default)
        if cell is None:
            problems.append(f"no row `| `{key}` | ... |`")
        elif want not in cell:
            problems.append(f"row {key}: values cell {cell!r} does not give the default as {want!r}")
    assert not problems, "docs/configuration.md:\n" + "\n".join(problems)


def test_configuration_names_every_value_and_legacy_flag():
    text = (DOCS / "configuration.md").read_text()
    values = (schema.MODES + schema.COMPONENTS + schema.WEIGHT_TRANSFERS + schema.CUDA_GRAPHS
              + schema.GRAPH_BOUNDARY_LOADS + WEIGHT_CODECS + (schema.RESIDENT_AUTO,))
    legacy = tuple(schema.LEGACY_MAPPED) + tuple(schema.LEGACY_REJECTED)
    missing = [v for v in values + legacy if f"`{v}`" not in text]
    assert not missing, f"docs/configuration.md does not name {missing}"
    for method in ("layerwise(", "module(", "from_json(", "from_dict(", "coerce(", "replace(", "to_dict()"):
        assert method in text, method


def test_configuration_json_blocks_are_valid_configs():
    blocks = _fences(DOCS / "configuration.md", "json")
    assert blocks
    for bid, _, code in blocks:
        config = OffloadConfig.from_json(code)
        assert OffloadConfig.from_dict(config.to_dict()) == config, bid


# ------------------------------------------------------------------ 2. python blocks

def _on_cpu(code: str) -> str:
    return re.sub(r'f?"cuda(:[^"]*)?"', '"cpu"', code).replace("\n    ...\n", "\n    pass\n")


def _namespace(code: str, tmp_path: Path) -> dict:
    from weightstream.demo_module import DeclaredToyPipeline
    from weightstream.models import flux_inputs, tiny_flux

    model = tiny_flux()
    ns = {"transformer": model, "dit": tiny_flux(), "same_kwargs_as_before": flux_inputs(model, device="cpu"),
          "pipe": DeclaredToyPipeline(), "rank": 0}
    if "checkpoint_dir" in code:
        tiny_flux().save_pretrained(str(tmp_path / "ckpt"))
        ns["checkpoint_dir"] = str(tmp_path / "ckpt")
    return ns


def test_pages_have_runnable_blocks_and_every_fence_is_known():
    assert any(bid.startswith("README.md") for bid, _ in RUN), "README.md needs a runnable python block"
    assert len(RUN) >= 10, [bid for bid, _ in RUN]  # the fence pattern still finds the blocks
    for bid, info, _ in NOT_RUN:
        assert NO_RUN.match(info), (
            f"{bid}: ```python{info}: a block either runs (```python) or is "
            "```python no-run equivalent=tests/<file>.py::<test name>")


@pytest.mark.parametrize("bid, code", RUN, ids=[bid for bid, _ in RUN])
def test_python_block_runs(bid, code, tmp_path):
    code = _on_cpu(code)
    group = "ParallelConfig" in code
    if group:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        with torch.no_grad():
            exec(compile(code, bid, "exec"), _namespace(code, tmp_path))
    finally:
        if group:
            dist.destroy_process_group()


def test_no_run_blocks_are_few_and_each_has_an_equivalent_test():
    listing = "\n".join(f"  {bid}: {info.strip()}" for bid, info, _ in NOT_RUN)
    print(f"{len(NOT_RUN)} python blocks not run (budget {NO_RUN_BUDGET}):\n{listing}")
    assert 1 <= len(NOT_RUN) <= NO_RUN_BUDGET, listing
    for bid, info, _ in NOT_RUN:
        m = NO_RUN.match(info)
        assert m, (bid, info)
        path, name = ROOT / m.group(1), m.group(2)
        assert path.is_file(), f"{bid}: equivalent {m.group(1)} does not exist"
        assert re.search(rf"^def {name}\(", path.read_text(), re.M), f"{bid}: no test {name} in {m.group(1)}"


def _quickstart() -> str:
    me = "tests/test_docs.py::test_readme_quickstart_on_a_tiny_flux_pipeline"
    blocks = [code for bid, info, code in NOT_RUN if bid.startswith("README.md") and info.strip().endswith(me)]
    assert len(blocks) == 1, "README.md needs the pipeline quickstart block that names this test"
    return blocks[0]


def _readme_offload_config(code: str) -> dict:
    """The config dict the quickstart passes to offload_pipeline (so this test follows the README)."""
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "offload_pipeline":
            return ast.literal_eval(node.args[1])
    raise AssertionError("the README quickstart calls no offload_pipeline(pipe, {...})")


def test_readme_quickstart_on_a_tiny_flux_pipeline(tmp_path):
    """The README's load / offload / generate / save, with the README's offload config, on a real
    FluxPipeline whose transformer and both text encoders stream: the resident pipeline's image bit
    for bit, and save_pretrained writes the real weights of every streamed component."""
    code = _quickstart()
    for step in ("FluxPipeline.from_pretrained(", "offload_pipeline(pipe,", "= pipe(", "pipe.save_pretrained("):
        assert step in code, f"the README quickstart lost its step {step!r}"
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    from weightstream import offload_pipeline

    pipe = tiny_flux_pipeline(tmp_path)
    resident = copy.deepcopy(pipe)
    expected = generate(resident)
    handle = offload_pipeline(pipe, {**_readme_offload_config(code), "progress": False}, device="cpu")
    assert set(handle.wrapped) == {"transformer", "text_encoder", "text_encoder_2"}, handle
    image = generate(pipe)
    assert torch.equal(image, expected)
    pipe.save_pretrained(str(tmp_path / "saved"))
    for sub, cls in (("transformer", FluxTransformer2DModel), ("text_encoder", CLIPTextModel),
                     ("text_encoder_2", T5EncoderModel)):
        back = cls.from_pretrained(str(tmp_path / "saved"), subfolder=sub).state_dict()
        want = getattr(resident, sub).state_dict()
        assert back.keys() == want.keys() and all(torch.equal(back[k], want[k]) for k in want), sub
    assert handle.disable() is pipe


# ------------------------------------------------------------------ 3. links

def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", _prose(page), re.M)}


def test_relative_links_point_to_existing_files_and_headings():
    broken, checked = [], 0
    for page in PAGES:
        for target in LINK.findall(_prose(page)):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            checked += 1
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
            if not dest.exists():
                if rel not in PENDING:
                    broken.append(f"{_rel(page)}: {target} (no file {rel})")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{_rel(page)}: {target} (no heading #{anchor} in {rel})")
    assert not broken, "\n".join(broken)
    assert checked >= 30, checked  # README and the pages link each other


def test_index_links_every_page():
    linked = {(DOCS / t.partition("#")[0]).resolve() for t in LINK.findall(_prose(DOCS / "README.md"))}
    pages = set(DOCS.glob("*.md")) - {DOCS / "README.md"}
    missing = sorted(p.name for p in pages if p.resolve() not in linked)
    assert not missing, f"docs/README.md does not link {missing}"
    assert "(docs/README.md)" in README.read_text()


# ------------------------------------------------------------------ 4. README budget

def test_readme_size_commands_rows_and_one_footnote():
    text = README.read_text()
    assert text.count("\n") <= 150 and len(text.encode()) <= 12000, (text.count("\n"), len(text.encode()))
    for command in ("make demo", "make test", "make test-gpu"):
        assert command in text, command
    results = text[text.index("## Results"):]
    results = results[: results.index("\n## ")]
    rows = [line for line in results.splitlines() if line.startswith("|")][2:]
    assert 1 <= len(rows) <= 8, rows
    footnotes = _footnotes(text)
    assert len(footnotes) == 1 and f"[^{footnotes[0][2:].split(']')[0]}]" in results, footnotes
    assert HASH.search(footnotes[0]) and re.search(r"\d{4}-\d{2}-\d{2}", footnotes[0]), footnotes[0]


def _footnotes(text: str) -> list[str]:
    return re.findall(r"^\[\^[\w-]+\]:.*(?:\n {4}.*)*", text, re.M)


def test_docs_carry_no_history():
    """No commit hashes, run, call or session numbers in README.md (but for its results footnote)
    and docs/: dated lines say when; git keeps the rest."""
    patterns = (HASH, re.compile(r"\bcall ?\d+\b"), re.compile(r"\b(?:run|session) \w*\d\w*\b"),
                re.compile(r"\b\w+teenth session\b|\b\w+th session\b"))
    found = []
    for page in PAGES:
        text = page.read_text()
        for note in _footnotes(text) if page == README else ():
            text = text.replace(note, "")
        found += [f"{_rel(page)}: {m.group(0)}" for pattern in patterns for m in pattern.finditer(text)]
    assert not found, found


# ------------------------------------------------------------------ 5. errors

def _error_classes() -> list[str]:
    names = []
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
                    names.append(node.name)
    return names


def test_errors_page_names_every_error_class():
    text = (DOCS / "errors.md").read_text()
    names = _error_classes()
    assert len(names) >= 20, names
    missing = [n for n in names if f"`{n}`" not in text]
    assert not missing, f"docs/errors.md does not name {missing}"


# ------------------------------------------------------------------ 6. command lines

def _cli_lines():
    for page in PAGES:
        for _, _, block in _fences(page, "bash"):
            for line in block.splitlines():
                line = line.split("#")[0].strip()
                if "-m weightstream " in line and "torchrun" not in line:
                    yield line.split("-m weightstream ", 1)[1]


@pytest.mark.parametrize("line", sorted(set(_cli_lines())))
def test_cli_lines_parse(line):
    argv = shlex.split(line)
    if argv[0] in ("bench", "monitor"):
        assert argv[0] in _parser().format_help()
        return
    argv = [a for a in argv if not (a.startswith("[") or a.endswith("]"))]  # optional-argument notation
    _parser().parse_args(argv)
