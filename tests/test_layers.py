"""The package's layers only import downwards: every import of a longspec module (at the top of a
file or inside a function) goes to the same layer or one below. A new module must be placed in
a layer here. Outside the command line, a module imports the package's own modules at its top
(no import hidden in a function)."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "longspec"

# top to bottom; a module belongs to the layer of the longest prefix that names it
LAYERS = [
    ["longspec", "longspec.cli"],  # (the package's own names: a facade that loads them on use)
    ["longspec.serving", "longspec.serving.http"],  # (the server: its package, its HTTP side)
    ["longspec.serving.server", "longspec.training", "longspec.parallel.workers", "longspec.parallel.serving",
     "longspec.parallel.mirror"],
    ["longspec.serving.engine_calls", "longspec.serving.request", "longspec.serving.tokenizing"],
    ["longspec.decoding"],  # a call: the Generator and its policy (auto, the controller)
    ["longspec.engine"],  # rounds over rows
    ["longspec.spec"],  # what a round proposes and how it is verified
    ["longspec.convert"],
    ["longspec.models"],
    ["longspec.kv.prefix_cache"],
    ["longspec.kv", "longspec.kv.cache"],  # the KV block pool
    ["longspec.attention"],
    ["longspec.parallel", "longspec.parallel.sharding", "longspec.parallel.group", "longspec.config",
     "longspec.compile_boundary", "longspec.files", "longspec.outdir", "longspec.status"],
]


def layer_of(module: str):
    found = [(len(p), i) for i, prefixes in enumerate(LAYERS) for p in prefixes
             if module == p or (p != "longspec" and module.startswith(p + "."))]
    return max(found)[1] if found else None


def upward_imports(package: Path) -> list:
    """Every import in ``package`` (a folder named longspec) of a module in a layer above the
    importing one, or by a module in no layer."""
    root = package.parent

    def name_of(path: Path) -> str:
        parts = list(path.relative_to(root).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    def is_module(name: str) -> bool:
        path = root.joinpath(*name.split("."))
        return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()

    wrong = []
    for path in sorted(package.rglob("*.py")):
        source = name_of(path)
        here = layer_of(source)
        if here is None:
            wrong.append(f"{source}: in no layer (add it to LAYERS)")
            continue
        parent = source if path.name == "__init__.py" else source.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = parent.split(".")[:len(parent.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                # (a name imported from a module counts as that module)
                targets = [f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base for a in node.names]
            else:
                continue
            for target in targets:
                if (target == "longspec" or target.startswith("longspec.")) and \
                        (layer_of(target) is None or layer_of(target) < here):
                    wrong.append(f"{path.relative_to(root)}:{node.lineno}: {source} imports {target}, a layer above")
    return wrong


def test_every_import_points_down_or_sideways():
    wrong = upward_imports(PACKAGE)
    assert not wrong, "\n".join(wrong)


def write_package(root: Path, files: dict) -> Path:
    """A folder ``longspec`` under ``root`` holding ``files`` ({path inside it: source})."""
    package = root / "longspec"
    for name, source in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(source)
    return package


def test_an_upward_import_is_caught_even_inside_a_function(tmp_path):
    package = write_package(tmp_path, {
        "__init__.py": "", "engine/__init__.py": "", "kv/__init__.py": "",
        "engine/engine.py": "from ..kv.cache import KVCache\n",  # (down: fine)
        "kv/cache.py": "def f():\n    from ..engine.engine import Engine\n"})
    assert upward_imports(package) == ["longspec/kv/cache.py:2: longspec.kv.cache imports longspec.engine.engine, "
                                       "a layer above"]


def function_local_imports(package: Path) -> list:
    """Imports of the package's own modules inside functions, outside ``cli/``: every module says
    what it needs at its top. The command line alone loads the library on use, so that
    ``longspec --help`` and ``--version`` answer without importing PyTorch."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] == "cli":
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                own = (isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("longspec"))) or \
                      (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "longspec" for a in node.names))
                if own:
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno} (in {fn.name})")
    return found


def test_the_package_imports_its_own_modules_at_the_top():
    found = function_local_imports(PACKAGE)
    assert not found, "\n".join(found)


def test_a_function_local_import_is_found(tmp_path):
    package = write_package(tmp_path, {
        "cli/main.py": "def main():\n    from ..engine import engine\n",  # (the CLI may)
        "kv/cache.py": "import os\n\n\ndef f():\n    if os:\n        from ..config import X\n"})
    assert function_local_imports(package) == ["longspec/kv/cache.py:6 (in f)"]
