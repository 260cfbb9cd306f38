"""The bench scripts still fit the code they measure: every bench/*.py imports without running (main() guarded by
__name__), and every quantlab name it uses resolves at HEAD. No model, no data, no subprocess: a bench that calls
a name a refactor removed fails here with its file, line and the missing name, not in a measurement hours later.

What is resolved, by walking each script's AST (module level and inside functions, scope by scope):
- `import quantlab.x [as y]`, `from quantlab.x import y [as z]`: the module and every imported name;
- attribute chains on a bound quantlab module (`prepare.load_model`, `evaluate.reference`, `search.Sensitivity`):
  followed through modules (a submodule not imported yet is imported) to the first non-module attribute;
- calls of a resolved quantlab function or class: the arguments bind to its signature, and a literal argument
  (a string, a number) matches the parameter's annotation where that is a plain class (`data.run(cfg, "eval", ...)`
  where a Role is required fails);
- `from conftest import ...` / `from test_audit import ...` / `from _converted import ...`: the names are defined at
  the top of that tests/ or bench/ file;
- string constants naming a quantlab module (`python -m quantlab.audit`) and bench/*.py paths in bench/*.sh exist;
- overrides written as string constants (`"gate.statistical.sequential=false"`, f"eval.max_windows={n}"): the
  dotted key exists in quantlab.config.Config's schema (a precision / engine key in some precision / engine schema).
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import sys
import types
import typing
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))
SHELL = sorted(BENCH.glob("*.sh"))
MODULE_NAME = re.compile(r"^quantlab(\.[A-Za-z_]\w*)+$")
OVERRIDE = re.compile(r"^[+~]{0,2}([a-z_]+(?:\.[A-Za-z0-9_]+)+)=")


def _subclasses(cls: type) -> list[type]:
    out = [cls]
    for sub in cls.__subclasses__():
        out += _subclasses(sub)
    return out


def _override_problem(key: str) -> str | None:
    """Why a dotted override key is not in Config's schema (None when it is, or when it is not a Config key)."""
    import dataclasses

    import quantlab.engines.registry  # noqa: F401 - registers the engine schemas (subclasses of EngineConfig)
    import quantlab.precisions  # noqa: F401 - the precision schemas
    from quantlab.config import Config

    parts = key.split(".")
    types_ = [Config]
    for i, part in enumerate(parts):
        found = []
        for cls in types_:
            for sub in _subclasses(cls):
                hints = typing.get_type_hints(sub)
                if part in {f.name for f in dataclasses.fields(sub)}:
                    found.append(hints[part])
        if not found:
            return None if i == 0 else f"{'.'.join(parts[:i])} has no key {part!r}"
        nxt = []
        for hint in found:
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            hint = args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint
            if typing.get_origin(hint) in (dict, typing.Dict) or hint is typing.Any:
                return None  # free-form below (gate.thresholds.<metric>.max)
            if dataclasses.is_dataclass(hint):
                nxt.append(hint)
        if not nxt and i < len(parts) - 1:
            return f"{'.'.join(parts[:i + 1])} is a value, not a section"
        types_ = nxt
    return None


def _resolve_module(name: str):
    """The quantlab module `name`, or None when it does not exist."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name):
            return None
        raise


def _attr(obj, name: str):
    """obj.name; for a package, also its submodule `name` (imported on demand). Raises AttributeError."""
    if hasattr(obj, name):
        return getattr(obj, name)
    if isinstance(obj, types.ModuleType) and hasattr(obj, "__path__"):
        sub = _resolve_module(f"{obj.__name__}.{name}")
        if sub is not None:
            return sub
    raise AttributeError(name)


def _bound_names(scope: ast.AST) -> set[str]:
    """Names a scope binds: arguments, assignments, loop / with / except targets, defs and imports (a quantlab
    import then binds the name again, to what it imports)."""
    names: set[str] = set()
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = scope.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
            if arg is not None:
                names.add(arg.arg)
    for node in _own_nodes(scope):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not scope:
            names.add(node.name)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
    return names


def _own_nodes(scope: ast.AST):
    """Every node of a scope, not descending into nested functions, lambdas or classes (their own scopes)."""
    stack = list(ast.iter_child_nodes(scope))
    if isinstance(scope, ast.Lambda):
        stack = [scope.body]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(d for d in getattr(node, "decorator_list", []))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                stack.extend(node.args.defaults + [d for d in node.args.kw_defaults if d is not None])
            continue
        stack.extend(ast.iter_child_nodes(node))


def _is_plain_class(hint) -> bool:
    return isinstance(hint, type) and hint not in (object, typing.Any) and not isinstance(hint, types.GenericAlias)


def _literal_mismatch(value, hint) -> bool:
    """A literal argument that cannot be what a plain-class annotation asks for (ints pass for floats)."""
    if not _is_plain_class(hint) or value is None:
        return False
    if hint is float and isinstance(value, int):
        return False
    return not isinstance(value, hint)


class _Checker:
    """Resolves one script's quantlab names; `problems` collects "bench/x.py:LINE: what is missing"."""

    def __init__(self, path: Path):
        self.path = path
        self.rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
        self.tree = ast.parse(path.read_text(), str(path))
        self.problems: list[str] = []

    def report(self, node: ast.AST, message: str) -> None:
        self.problems.append(f"{self.rel}:{getattr(node, 'lineno', 0)}: {message}")

    # ---------------------------------------------------------------------------------- imports
    def imports(self, scope: ast.AST) -> dict[str, object]:
        """name -> object of the quantlab imports a scope makes (missing ones reported)."""
        env: dict[str, object] = {}
        for node in _own_nodes(scope):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "quantlab" or alias.name.startswith("quantlab."):
                        mod = _resolve_module(alias.name)
                        if mod is None:
                            self.report(node, f"import {alias.name}: no such module")
                        elif alias.asname:
                            env[alias.asname] = mod
                        else:
                            env["quantlab"] = importlib.import_module("quantlab")
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module == "quantlab" or node.module.startswith("quantlab."):
                    mod = _resolve_module(node.module)
                    if mod is None:
                        self.report(node, f"from {node.module} import ...: no module {node.module}")
                        continue
                    for alias in node.names:
                        try:
                            env[alias.asname or alias.name] = _attr(mod, alias.name)
                        except AttributeError:
                            self.report(node, f"from {node.module} import {alias.name}: {node.module} has no "
                                              f"{alias.name!r}")
                elif self.local_module(node.module):
                    self.local_names(node)
        return env

    @staticmethod
    def local_module(name: str) -> Path | None:
        """The bench/ or tests/ file a script imports by its bare name (bench/ is the script's own directory;
        the benches put tests/ on sys.path for conftest's model builders)."""
        if name == "conftest" or name.startswith("test_") or (name.startswith("_") and not name.startswith("__")):
            return next((d / f"{name}.py" for d in (BENCH, REPO / "tests") if (d / f"{name}.py").is_file()),
                        REPO / "tests" / f"{name}.py")
        return None

    def local_names(self, node: ast.ImportFrom) -> None:
        source = self.local_module(node.module)
        if not source.is_file():
            self.report(node, f"from {node.module} import ...: no bench/{node.module}.py or tests/{node.module}.py")
            return
        tree = ast.parse(source.read_text())
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        for n in tree.body:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
            defined |= {t.id for t in targets if isinstance(t, ast.Name)}
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                defined |= {(a.asname or a.name).split(".")[0] for a in n.names}
        for alias in node.names:
            if alias.name not in defined:
                self.report(node, f"from {node.module} import {alias.name}: {source.relative_to(REPO)} defines "
                                  f"no {alias.name!r}")

    # ------------------------------------------------------------------------------------- scopes
    def check(self) -> list[str]:
        self.scope(self.tree, {})
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_NAME.match(node.value):
                if importlib.util.find_spec(node.value) is None:
                    self.report(node, f"{node.value!r}: no such module")
            text = None
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
                text = str(node.values[0].value)
            match = OVERRIDE.match(text) if text and not text.startswith("hydra.") else None
            if match and (problem := _override_problem(match.group(1))):
                self.report(node, f"override {text.split('=')[0]}=: {problem}")
        unique = dict.fromkeys(self.problems)  # a chain inside a call is resolved twice
        return sorted(unique, key=lambda p: int(p.split(":")[1]))

    def scope(self, scope: ast.AST, outer: dict[str, object]) -> None:
        env = {k: v for k, v in outer.items() if k not in _bound_names(scope)}
        env.update(self.imports(scope))
        for node in _own_nodes(scope):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                self.scope(node, env)
            elif isinstance(node, ast.ClassDef):
                self.scope(node, env)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                self.chain(node, env)
            elif isinstance(node, ast.Call):
                self.call(node, env)

    def chain(self, node: ast.Attribute, env: dict[str, object]):
        """Resolve name.a.b... through modules; report the first missing attribute. Returns the object or None."""
        parts, base = [], node
        while isinstance(base, ast.Attribute):
            parts.append(base.attr)
            base = base.value
        if not isinstance(base, ast.Name) or not isinstance(env.get(base.id), types.ModuleType):
            return None
        obj, path = env[base.id], base.id
        for part in reversed(parts):
            if not isinstance(obj, types.ModuleType):
                return None  # attributes of a function, class or value: not resolved statically
            try:
                obj = _attr(obj, part)
            except AttributeError:
                self.report(node, f"{path}.{part}: {obj.__name__} has no {part!r}")
                return None
            path = f"{path}.{part}"
        return obj

    def call(self, node: ast.Call, env: dict[str, object]) -> None:
        func = node.func
        if isinstance(func, ast.Name):
            target = env.get(func.id)
        elif isinstance(func, ast.Attribute):
            target = self.chain(func, env)  # reported there when missing (reported twice is fine: same line)
        else:
            return
        if target is None or isinstance(target, types.ModuleType) or not callable(target):
            return
        if not getattr(target, "__module__", "").startswith("quantlab"):
            return
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            return
        name = getattr(target, "__qualname__", repr(target))
        try:
            sig = inspect.signature(target)
        except (TypeError, ValueError):
            return
        try:
            bound = sig.bind(*node.args, **{k.arg: k.value for k in node.keywords})
        except TypeError as exc:
            self.report(node, f"{target.__module__}.{name}(...): {exc}")
            return
        try:
            hints = typing.get_type_hints(target.__init__ if isinstance(target, type) else target)
        except Exception:  # noqa: BLE001 - annotations that do not evaluate are not this test's business
            return
        for param, arg in bound.arguments.items():
            if isinstance(arg, ast.Constant) and param in hints and _literal_mismatch(arg.value, hints[param]):
                self.report(arg, f"{target.__module__}.{name}(...): {param}={arg.value!r} is a "
                                 f"{type(arg.value).__name__}, {hints[param].__name__} required")


def test_the_checker_finds_what_a_refactor_removes(tmp_path):
    """The checker itself: each kind of stale use is caught with its line; correct uses, and a name another import
    shadows in an inner scope, are not reported."""
    stale = tmp_path / "stale_example.py"
    stale.write_text(
        "from quantlab.stages import data, evaluate\n"
        "from quantlab.config import PRECISION_SCHEMAS\n"
        "import quantlab.nothing_here\n"
        "from quantlab.gate import stats\n"
        "def main():\n"
        "    from quantlab.gate import metrics\n"
        "    from scipy import stats\n"
        "    stats.norm.isf(0.05)\n"
        "    metrics.PositionStats(1, 2)\n"
        "    evaluate.reference(1, 2, 3, 4, 5)\n"
        "    data.run(cfg, 'eval', fp, tok, store)\n"
        "    data.run(cfg, data.EVAL, fp, tok, store, 5, 6, 7)\n"
        "    cmd = ['-m', 'quantlab.no_such_tool']\n"
        "    f = lambda stats: stats.anything\n"
        "    ok = ['gate.statistical.sequential=false', f'eval.max_windows={n}', 'precision.block_size=64', "
        "'gate.thresholds.kl_p99.max=0.5', 'engine.checkpoint=x', 'search.int4_block_sizes=[]']\n"
        "    bad = ['gate.statistical.enabled=false', f'eval.windows={n}', '++model.nothing=1']\n"
        "def other():\n"
        "    stats.interval([1.0], 2.0)\n"
        "    stats.no_such_function()\n"
        "    data.run(cfg, data.EVAL, fp, tok, store)\n"
        "    from _converted import seed_converted_model, nothing_here\n"
        "if __name__ == '__main__':\n"
        "    main()\n")
    found = _Checker(stale).check()
    lines = {int(p.split(":")[1]) for p in found}
    assert lines == {2, 3, 9, 10, 11, 12, 13, 16, 19, 21}, "\n".join(found)
    text = "\n".join(found)
    for what in ("PRECISION_SCHEMAS", "quantlab.nothing_here", "'PositionStats'", "'reference'",
                 "role='eval' is a str, Role required", "too many", "quantlab.no_such_tool", "'no_such_function'",
                 "gate.statistical has no key 'enabled'", "eval has no key 'windows'", "model has no key 'nothing'",
                 "bench/_converted.py defines no 'nothing_here'"):
        assert what in text, (what, text)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bench_script_imports_and_its_quantlab_names_resolve(script, monkeypatch):
    path = list(sys.path)
    name = f"_bench_{script.stem}"
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "argv", [str(script), "--help-not-run"])  # a main() run at import fails loudly
    monkeypatch.setitem(sys.modules, name, module)  # as an import registers it (dataclasses look their module up)
    try:
        spec.loader.exec_module(module)  # main() must be guarded by `if __name__ == "__main__"`
    finally:
        sys.path[:] = path
    tree = ast.parse(script.read_text())
    if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):  # helpers (_x.py) have none
        assert any(isinstance(n, ast.If) and "__name__" in ast.unparse(n.test) for n in tree.body), \
            f"{script.name}: main() not guarded by `if __name__ == \"__main__\":`"
    problems = _Checker(script).check()
    assert not problems, "stale names in bench scripts:\n" + "\n".join(problems)


@pytest.mark.parametrize("script", SHELL, ids=lambda p: p.name)
def test_bench_shell_scripts_name_existing_benches(script):
    text = script.read_text()
    named = set(re.findall(r"bench/([\w.-]+\.py)", text))
    assert named, f"{script.name} runs no bench script"
    for bench in named:
        assert (BENCH / bench).is_file(), f"{script.name} runs bench/{bench}, which does not exist"
