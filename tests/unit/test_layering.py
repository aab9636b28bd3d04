"""The layers of ``memcache_core`` (docs/design.md, "Where things live"), read from the source: every
import statement, at module level or inside a function or ``if TYPE_CHECKING``, counts.

* leaf modules import only leaf modules;
* the control-plane plumbing (``rpc``, ``endpoints``, ``etcd``, ``http_guard``) imports leaves and itself;
* ``transfer/`` and ``meta/`` import the two layers below and themselves, never each other nor ``local/``;
* ``local/`` may use ``transfer/`` (it owns the transfer engine), never ``meta/``;
* the entry points (the package, ``meta_service``, ``cli``, ``cli_status``, ``testing`` and its
  ``testing_*`` siblings) sit on top;
* nothing in the core imports an integration or an engine, and the two integrations do not import
  each other;
* no import cycles, inside a layer either: a helper never imports the module that imports it (shared
  types live in a leaf module; what a helper needs of its owner is passed in);
* no private name (``_x``) is imported from another module: a name two modules use has no underscore.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "memcache_core"

LEAF = {"errors", "values", "ascend_keys", "config", "config_check", "config_meta", "protocol", "layout", "memory", "auth", "secret_file", "tls", "logs",
        "checkpoint", "records", "host", "fence", "nativelib", "protocol_disk"}
PLUMBING = {"rpc", "endpoints", "etcd", "http_guard"}
ENTRY = {"__init__", "meta_service", "cli", "cli_status", "cli_secrets", "testing", "testing_etcd", "testing_kv_events"}
PACKAGES = {"transfer", "meta", "local"}
ALLOWED = {
    "leaf": {"leaf"},
    "plumbing": {"leaf", "plumbing"},
    "transfer": {"leaf", "plumbing", "transfer"},
    "meta": {"leaf", "plumbing", "meta"},
    "local": {"leaf", "plumbing", "transfer", "local"},
    "entry": {"leaf", "plumbing", "transfer", "meta", "local", "entry"},
}
# (importing module, imported module) pairs that break a rule today, each with the reason it stays.
KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()
ENGINES = ("sglang", "vllm", "torch", "memcache_sglang", "memcache_vllm", "integrations")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The absolute names of the modules ``path`` imports (relative imports resolved)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
            found.update([f"{base}.{node.module}"] if node.module else [f"{base}.{a.name}" for a in node.names])
    return found


def layer(module: str) -> str:
    """The layer of a ``memcache_core`` module (KeyError for one no rule places)."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    if top in PACKAGES:
        return top
    return {**dict.fromkeys(LEAF, "leaf"), **dict.fromkeys(PLUMBING, "plumbing"),
            **dict.fromkeys(ENTRY, "entry")}[top]


def core_files() -> list[Path]:
    return sorted(CORE.rglob("*.py"))


def test_every_core_module_has_a_layer():
    unplaced = []
    for f in core_files():
        try:
            layer(module_name(f))
        except KeyError:
            unplaced.append(module_name(f))
    assert unplaced == [], "place these modules in a layer here and in docs/design.md"


@pytest.mark.parametrize("path", core_files(), ids=lambda p: module_name(p))
def test_no_import_runs_upward_or_sideways(path: Path):
    importer = module_name(path)
    upward = [(importer, m) for m in sorted(imports(path))
              if m.split(".")[0] == "memcache_core" and layer(m) not in ALLOWED[layer(importer)]]
    assert [u for u in upward if u not in KNOWN_EXCEPTIONS] == [], \
        f"{layer(importer)} may import only {sorted(ALLOWED[layer(importer)])}"


@pytest.mark.parametrize("path", core_files(), ids=lambda p: module_name(p))
def test_the_core_never_imports_an_integration_or_an_engine(path: Path):
    assert [m for m in imports(path) if m.split(".")[0] in ENGINES] == []


def import_graph() -> dict[str, set[str]]:
    """Each core module and the core modules it imports (a name inside a module, ``from . import x``
    of a function, counts as that module)."""
    modules = {module_name(f): f for f in core_files()}

    def owner(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    return {m: {owner(i) for i in imports(f) if i.split(".")[0] == "memcache_core"} - {m}
            for m, f in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a path (``[a, b, a]``), or [] when there is none."""
    done: set[str] = set()

    def walk(m: str, path: list[str]) -> list[str]:
        if m in path:
            return path[path.index(m):] + [m]
        if m in done:
            return []
        for n in sorted(graph[m]):
            found = walk(n, path + [m])
            if found:
                return found
        done.add(m)
        return []

    for m in sorted(graph):
        found = walk(m, [])
        if found:
            return found
    return []


def test_no_import_cycles():
    """Scenario: ``local/drain.py`` imports ``local/service.py`` (even only for a type) while the service
    imports the drainer: a circle a reader cannot enter anywhere. Pass the owner in as a ``Protocol``."""
    cycle = find_cycle(import_graph())
    assert cycle == [], "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    """Negative control: the finder sees a circle through a package's module and a type-only import."""
    graph = import_graph()
    graph["memcache_core.local.drain"] = graph["memcache_core.local.drain"] | {"memcache_core.local.service"}
    cycle = find_cycle(graph)
    assert cycle[0] == cycle[-1] and "memcache_core.local.drain" in cycle
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def private_imports(path: Path) -> list[str]:
    """``from m import _x`` statements of ``path`` (``__future__`` and dunders aside)."""
    return [f"{node.module or '.'}.{a.name}" for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.ImportFrom) for a in node.names
            if a.name.startswith("_") and not a.name.startswith("__")]


@pytest.mark.parametrize("path", [f for top in ("memcache_core", "integrations", "tests", "benchmarks", "examples")
                                  for f in sorted((REPO / top).rglob("*.py"))],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_no_private_name_is_imported_from_another_module(path: Path):
    assert private_imports(path) == [], "a name used by two modules goes where both see it, without an underscore"


def test_the_private_import_rule_sees_one(tmp_path: Path):
    """Negative control: the rule reads ``from .writes import _valid_key`` (as reads.py had it)."""
    f = tmp_path / "m.py"
    f.write_text("from __future__ import annotations\nfrom .writes import _valid_key, check_key\n")
    assert private_imports(f) == ["writes._valid_key"]


@pytest.mark.parametrize("this, other", [("memcache_sglang", "memcache_vllm"), ("memcache_vllm", "memcache_sglang")])
def test_the_integrations_do_not_import_each_other(this: str, other: str):
    files = sorted((REPO / "integrations" / this).rglob("*.py"))
    assert files
    assert [str(f.relative_to(REPO)) for f in files if any(m.split(".")[0] == other for m in imports(f))] == []


def test_the_rules_see_relative_imports():
    """The resolver itself: ``from ..transfer import engine`` in local/ is transfer/, ``from . import x``
    in a package is that package's module (a rule that never sees an import passes for nothing)."""
    seen = imports(CORE / "local" / "service.py")
    assert "memcache_core.transfer" in seen and "memcache_core.protocol" in seen
    assert layer("memcache_core.transfer.engine") == "transfer" and layer("memcache_core") == "entry"
    assert layer("memcache_core.local.store") not in ALLOWED[layer("memcache_core.transfer.shm")]


def product_files() -> list[Path]:
    """The shipped code: the core and the integrations (tests may reach into anything)."""
    return [f for top in ("memcache_core", "integrations") for f in sorted((REPO / top).rglob("*.py"))]


def private_members(path: Path) -> set[str]:
    """The private names (``_x``, not dunders) the classes of ``path`` define: methods, attributes
    assigned on ``self`` and annotated class attributes."""
    found: set[str] = set()
    for cls in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(cls, ast.ClassDef):
            continue
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                found.add(node.target.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id == "self"):
                found.add(node.attr)
    return {n for n in found if n.startswith("_") and not n.startswith("__")}


def reach_ins(files: list[Path]) -> list[str]:
    """``x._name`` (``x`` not ``self`` or ``cls``) where ``_name`` is private to a class of another of
    ``files`` and none of the accessing module's own: ``file:line expression``."""
    owners: dict[str, set[Path]] = {}
    for f in files:
        for name in private_members(f):
            owners.setdefault(name, set()).add(f)
    found = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Attribute) and node.attr in owners and f not in owners[node.attr]
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{f.relative_to(REPO) if f.is_relative_to(REPO) else f.name}:{node.lineno} "
                             f"{ast.unparse(node)}")
    return found


def test_no_private_attribute_is_reached_into_from_another_module():
    """What a helper calls on the object that owns it (``svc.member_call``, ``svc.segment_info``) is a
    public name of that object; an underscore name stays inside the module that defines it."""
    assert reach_ins(product_files()) == [], "make the attribute a public name (no underscore), or keep its use inside its module"


def test_the_reach_in_rule_sees_one(tmp_path: Path):
    """Negative control: ``self.svc._member_call`` (as local/drain.py had it) is seen; ``self._x``, a
    module's use of its own class's ``_x`` and a private name no class of ours defines are not."""
    owner, helper = tmp_path / "owner.py", tmp_path / "helper.py"
    owner.write_text("class Svc:\n    def __init__(self):\n        self._n = 0\n"
                     "    def _member_call(self):\n        return self._n\n\n"
                     "def peek(s: Svc) -> int:\n    return s._n\n")
    helper.write_text("import os\n\nclass Helper:\n    def run(self):\n        os._exit(0)\n"
                      "        return self.svc._member_call(), self._own()\n")
    assert reach_ins([owner, helper]) == ["helper.py:6 self.svc._member_call"]


@pytest.mark.parametrize("path", product_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_module_has_at_most_400_lines(path: Path):
    """A module a reader takes in at once: a longer one is split by moving whole units (a class, a
    group of functions) into a well-named sibling module."""
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= 400, f"{path.relative_to(REPO)} has {lines} lines (at most 400): move a whole unit out"
