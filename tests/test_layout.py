"""shared/'s modules import one another in one direction: no module reaches itself through its imports,
counting the imports inside functions (a circle there still ties the modules together)."""
import ast
from pathlib import Path

SHARED = Path(__file__).resolve().parent.parent / "shared"


def _module(path: Path) -> str:
    parts = path.relative_to(SHARED.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, known: set) -> set:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                for candidate in (f"{base}.{alias.name}", base):
                    if candidate in known:
                        out.add(candidate)
                        break
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
    return out - {name}


def import_graph() -> dict:
    files = {_module(p): p for p in SHARED.rglob("*.py")}
    known = set(files)
    # a package's __init__ is what "from . import x" passes through; count the edges of the modules only
    return {name: _imports(path, name, known) for name, path in files.items()}


def test_no_import_circle_among_shared_modules():
    graph = import_graph()
    circles = []

    def visit(node, path):
        for nxt in graph.get(node, ()):
            if nxt == path[0]:
                circles.append(" -> ".join(path + [nxt]))
            elif nxt not in path and len(path) < 12:
                visit(nxt, path + [nxt])

    for start in graph:
        if not start.endswith("__init__"):
            visit(start, [start])
    # packages import their own modules to re-export them; a circle through a package's __init__ alone is not one
    circles = [c for c in circles if not any(part in ("shared", "shared.codecs") for part in c.split(" -> "))]
    assert not circles, "import circles:\n" + "\n".join(sorted(set(circles))[:20])


CODEC_LAYERS = ["shared.container", "shared.launches", "shared.cuda_graphs", "shared.batched", "shared.pipeline"]


def test_codec_layers_import_downward_only():
    """The codec's five modules (shared/launches.py says what each holds) import only those below them:
    the batched calls take codec objects and call their methods, never the module of the codec classes."""
    graph = import_graph()
    for i, layer in enumerate(CODEC_LAYERS):
        above = set(CODEC_LAYERS[i + 1:])
        assert not graph[layer] & above, f"{layer} imports {sorted(graph[layer] & above)}, a layer above it"
