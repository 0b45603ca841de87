"""Tier 1: the package's imports run one way.

    training/, learning/, harness/   (use the library)
      -> api -> communicator -> transports/ -> views, errors, _types -> _C

Every import in every module of ringcoll/ (also those inside functions) is read from the
source and checked against that order, and ``import ringcoll`` is checked to load no module
that imports the package back.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ringcoll"

# Lower layers may not import higher ones; a layer may import itself (no cycles, checked below).
LAYERS = [
    ("ringcoll._C",),
    ("ringcoll._types", "ringcoll.errors", "ringcoll.views", "ringcoll.packing", "ringcoll._moved", "ringcoll.plans",
     "ringcoll.tuning"),
    ("ringcoll.bootstrap",),
    ("ringcoll.transports",),
    ("ringcoll.communicator",),
    ("ringcoll.api",),
    ("ringcoll.training", "ringcoll.learning", "ringcoll.harness"),
    ("ringcoll",),  # the package itself: only its users import it
]


def layer_of(module: str) -> int:
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    assert best is not None, module
    return best[0]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    relative = Path(*name.split("."))
    return (PACKAGE.parent / relative).with_suffix(".py").exists() or (PACKAGE.parent / relative / "__init__.py").exists()


def imports_of(path: Path) -> set:
    """The ringcoll modules `path` imports, anywhere in the file."""
    found = set()
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "ringcoll")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "ringcoll":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if is_module(sub) or sub == "ringcoll._C" else base)
    found.discard(me)
    return found


GRAPH = {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_go_down_the_layers(module):
    upward = [m for m in sorted(GRAPH[module]) if layer_of(m) > layer_of(module)]
    assert not upward, f"{module} imports {upward}, above it"


def test_no_import_cycles():
    state: dict = {}

    def visit(module, trail):
        if state.get(module) == "done":
            return
        assert state.get(module) != "active", "import cycle: " + " -> ".join(trail + [module])
        state[module] = "active"
        for dep in sorted(GRAPH.get(module, ())):
            visit(dep, trail + [module])
        state[module] = "done"

    for module in sorted(GRAPH):
        visit(module, [])


def test_import_ringcoll_loads_nothing_that_imports_it_back():
    code = "import sys, ringcoll; print('\\n'.join(sorted(m for m in sys.modules if m.startswith('ringcoll'))))"
    loaded = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    assert "ringcoll.transports.host" in loaded and "ringcoll.training.backend" in loaded
    back = [m for m in loaded if m != "ringcoll" and "ringcoll" in GRAPH.get(m, ())]
    assert not back, f"imported by `import ringcoll` and importing it back: {back}"


def test_old_module_paths_are_the_new_modules():
    # Moved modules keep their old import paths, as the very same module objects.
    import ringcoll.learning.model
    import ringcoll.model
    import ringcoll.training.zero
    from ringcoll.testing import spawn
    from ringcoll.zero import ShardedOptimizer

    from ringcoll.harness.launcher import spawn as launcher_spawn

    assert ringcoll.model is ringcoll.learning.model and spawn is launcher_spawn
    assert ShardedOptimizer is ringcoll.training.zero.ShardedOptimizer
    assert ringcoll.learning.model.__spec__.name == "ringcoll.learning.model"
    out = subprocess.run([sys.executable, "-m", "ringcoll.model", "--help"], check=True, capture_output=True,
                         text=True).stdout
    assert "usage" in out


def test_test_files_have_unique_names():
    # The test folders are not packages, so pytest imports each file by its bare name: two files
    # with one name stop the whole run at collection (only a full run shows it, not one file).
    tests = Path(__file__).resolve().parents[1]
    names = sorted(p.name for p in tests.rglob("test_*.py"))
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})


def test_data_files_the_package_reads_are_installed_with_it():
    # `pip install .` (the README's main job) copies only what pyproject.toml declares; the
    # tests run an editable install, which would not notice a file left out.
    import tomllib

    from ringcoll import tuning

    declared = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    data = sorted(p.name for p in PACKAGE.iterdir() if p.is_file() and p.suffix == ".json")
    assert data == [tuning.DEFAULT_TABLE.name] and declared == {"ringcoll": data}


def test_the_extension_exports_its_entry_point_only():
    """ringcoll._C exports PyInit__C and nothing else (csrc/bindings/exports.map): C++ runtime
    code it exported (stringstream, ostream inserters, ...) could be bound to by other
    libraries, or its own calls to another copy (CMakeLists.txt says why; on the first GPU
    run every error path crashed in such code)."""
    from ringcoll import _C

    done = subprocess.run(["nm", "-D", "--defined-only", _C.__file__], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    exported = [line.split()[-1] for line in done.stdout.splitlines() if line.strip()]
    assert exported == ["PyInit__C"], exported[:10]


def test_every_transport_has_the_whole_interface():
    """The Communicator calls the base interface on whichever transport it holds (e.g. the
    arenas of symmetric memory, before auto chooses): every transport class, the emulated
    CUDA one included, must subclass Transport so that it has each of its members."""
    from ringcoll.transports import base, cuda, emulated, host

    for cls in (host.HostTransport, cuda.CudaTransport, emulated.EmulatedCudaTransport):
        assert issubclass(cls, base.Transport), cls
        for member in ("allocate_symmetric", "is_symmetric", "symmetric_arenas", "broken", "plain_calls"):
            assert hasattr(cls, member), (cls, member)
