"""Every ```python block in README.md and docs/*.md runs as written (a user's first copy-paste works).

Each block is compiled; each block is then run in a fresh namespace with a temporary directory as
the working directory, unless its first line says what it needs and this machine lacks it:

    # needs: cuda                 a CUDA GPU (run here when torch sees one)
    # needs: model                a pretrained model's weights (never run here: no hub access)
    # needs: two processes        one process per rank (never run in one interpreter)

several joined by commas (`# needs: cuda, two processes`). A new block without such a line must run.
The public names a block imports from shared.* (and the methods it calls on them) have docstrings.
"""
import ast
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
PYTHON = {"python", "py", "python3", "pycon"}
NEEDS = re.compile(r"^#\s*needs:\s*(.+?)\s*$")
KNOWN_NEEDS = {"cuda", "model", "two processes"}
# blocks slower than ~5 s on a 2-core CPU (transformers' import alone takes ~3 s): (file, text in the block)
SLOW = {("docs/library.md", "cache = SpillCache("), ("docs/library.md", "SpillCache.from_kv_codec("),
        ("docs/kv-codec.md", "calibrate_scale(codec"), ("README.md", "load_shipped(")}


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def collect(paths=DOCS, root=ROOT) -> list[tuple[str, int, str]]:
    """(file relative to the repo, line of the opening fence, source) for every python fenced block."""
    blocks = []
    for path in paths:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i].strip())
            if m is None:
                i += 1
                continue
            start, lang = i, m.group(1).lower()
            i += 1
            body = []
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise AssertionError(f"{path.relative_to(root)}:{start + 1}: unclosed code fence")
            i += 1
            if lang in PYTHON:
                blocks.append((str(path.relative_to(root)), start + 1, "\n".join(body) + "\n"))
    return blocks


BLOCKS = collect()


def needs_of(src: str) -> set[str]:
    first = src.lstrip("\n").splitlines()[0] if src.strip() else ""
    m = NEEDS.match(first.strip())
    return set() if m is None else {n.strip() for n in m.group(1).split(",")}


def params():
    out = []
    for name, line, src in BLOCKS:
        slow = any(name == f and marker in src for f, marker in SLOW)
        out.append(pytest.param(name, line, src, id=f"{name}:{line}", marks=[pytest.mark.slow] if slow else []))
    return out


def test_blocks_found():
    assert len(BLOCKS) >= 8, [f"{n}:{l}" for n, l, _ in BLOCKS]


@pytest.mark.parametrize("name,line,src", params())
def test_snippet_runs(name, line, src, tmp_path, monkeypatch):
    code = compile(src, f"{name}:{line}", "exec")  # every block, runnable here or not, is valid Python
    needs = needs_of(src)
    unknown = needs - KNOWN_NEEDS
    assert not unknown, f"{name}:{line}: unknown '# needs:' {sorted(unknown)}; use {sorted(KNOWN_NEEDS)}"
    missing = {n for n in needs if not (n == "cuda" and _cuda())}
    if missing:
        pytest.skip(f"needs {', '.join(sorted(missing))}")
    monkeypatch.chdir(tmp_path)
    exec(code, {"__name__": "__snippet__"})


def _used_shared_objects(src: str) -> dict[str, object]:
    """{qualified name: object} for each name a block imports from shared.* and each public method or
    attribute it reaches on those (codec.encode -> TensorCodec.encode when TensorCodec is imported)."""
    import importlib

    tree = ast.parse(src)
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "shared":
            module = importlib.import_module(node.module)
            for alias in node.names:
                found[f"{node.module}.{alias.name}"] = getattr(module, alias.name)
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and not n.attr.startswith("_")}
    for qual, obj in list(found.items()):
        if inspect.isclass(obj):
            for attr in attrs:
                member = inspect.getattr_static(obj, attr, None)
                if member is not None and (callable(member) or isinstance(member, (classmethod, staticmethod, property))):
                    found[f"{qual}.{attr}"] = getattr(obj, attr)
    return found


@pytest.mark.parametrize("name,line,src", [pytest.param(*b, id=f"{b[0]}:{b[1]}") for b in BLOCKS])
def test_snippet_names_have_docstrings(name, line, src):
    undocumented = [qual for qual, obj in _used_shared_objects(src).items() if not inspect.getdoc(obj)]
    assert not undocumented, f"{name}:{line} uses public names without a docstring: {undocumented}"


def test_collect_sees_blocks_and_needs(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("text\n```python\n# needs: cuda, model\nx = 1\n```\n```bash\nls\n```\n```py\ny = 2\n```\n")
    (a, la, sa), (b, lb, sb) = collect([doc], root=tmp_path)
    assert (a, la, lb) == ("x.md", 2, 9) and needs_of(sa) == {"cuda", "model"} and needs_of(sb) == set()
