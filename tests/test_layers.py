"""The package layout's import rules, checked on the source, not stated in prose.

Each folder of ``fl_geo/`` is a layer or a subsystem with a rule about what it may import (its
``__init__`` docstring says why). The test parses every module's ``import`` statements, including
those inside functions, and fails naming the module and the import that breaks a rule. The docs
must name every package, so the README's layout section and ``docs/design.md`` follow the tree.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fl_geo"

# Layer -> (fl_geo modules or packages it may import, third-party top-level modules it may import).
# The standard library is always allowed. A rule names prefixes: "fl_geo.core" allows
# fl_geo.core and everything below it.
_LEAVES = ("fl_geo.errors", "fl_geo.atomic", "fl_geo.hosts", "fl_geo.fork_server")  # standard library (and fl_geo.errors) only: importable from every layer
RULES: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "core": (("fl_geo.core", *_LEAVES), frozenset({"torch", "numpy"})),
    "timing": (("fl_geo.core", "fl_geo.timing", *_LEAVES), frozenset({"torch", "numpy"})),
    # tokenizers, datasets: optional extras (fl-geo[hf], fl-geo[data]), imported inside the
    # functions that train a BPE or read a local jsonl/parquet/arrow file only
    "data": (("fl_geo.data", *_LEAVES), frozenset({"torch", "numpy", "tokenizers", "datasets"})),
    # transformers: optional extra (fl-geo[hf]), imported only when a model.kind=hf model is built
    "inner": (("fl_geo.core", "fl_geo.data", "fl_geo.inner", *_LEAVES),
              frozenset({"torch", "numpy", "transformers"})),
    "ps": (("fl_geo.core", "fl_geo.ps", *_LEAVES), frozenset({"torch", "numpy", "grpc"})),
    "runtime": (
        ("fl_geo.core", "fl_geo.timing", "fl_geo.data", "fl_geo.inner", "fl_geo.runtime",
         "fl_geo.config", "fl_geo.registry", *_LEAVES),
        # safetensors: optional (fl-geo[safetensors]), imported inside RunSession's model export only
        frozenset({"torch", "numpy", "flwr", "safetensors"}),
    ),
}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a module; relative imports are resolved."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from fl_geo.core import state` imports the module fl_geo.core.state
            out += [(node.lineno, f"{module}.{a.name}" if module.startswith("fl_geo") else module)
                    for a in node.names]
    return out


def violations(layer: str, files: list[Path] | None = None) -> list[str]:
    """Every import in ``fl_geo/<layer>/`` that its rule does not allow, as 'file:line: module'."""
    allowed_fl, allowed_ext = RULES[layer]
    found = []
    for path in files if files is not None else sorted((PACKAGE / layer).rglob("*.py")):
        for line, module in _imports(path):
            top = module.split(".")[0]
            if top == "fl_geo":
                ok = any(module == a or module.startswith(a + ".") for a in allowed_fl)
            else:
                ok = top in sys.stdlib_module_names or top in allowed_ext
            if not ok:
                found.append(f"{path.relative_to(ROOT)}:{line}: imports {module}")
    return found


@pytest.mark.parametrize("layer", sorted(RULES))
def test_layer_imports_follow_the_rule(layer):
    assert (PACKAGE / layer / "__init__.py").is_file()
    assert violations(layer) == [], f"fl_geo/{layer}/ breaks its import rule (see its __init__ docstring)"


def test_the_check_catches_a_core_module_that_imports_flower(tmp_path):
    """The rule is not vacuous: a core module importing Flower, the config schema or a runtime
    module is caught, also when the import hides inside a function."""
    bad = PACKAGE / "core" / "_scratch_bad_import.py"
    bad.write_text("import torch\n\n\ndef f():\n    from flwr.app import ArrayRecord\n"
                   "    from fl_geo.config import FlGeoConfig\n    import fl_geo.runtime.wire\n")
    try:
        found = violations("core", [bad])
    finally:
        bad.unlink()
    assert [f.split(": ", 1)[1] for f in found] == [
        "imports flwr.app", "imports fl_geo.config.FlGeoConfig", "imports fl_geo.runtime.wire"]


def test_nothing_below_the_entry_points_imports_them():
    """The CLI is the outermost entry point: no module of the package imports it."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, module in _imports(path):
            assert module != "fl_geo.cli" and not module.startswith("fl_geo.cli."), f"{path.relative_to(ROOT)}:{line} imports the CLI"


def test_every_package_is_named_in_the_readme_layout_and_the_design_notes():
    packages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = readme[readme.index("## Layout"):]  # fl_geo/'s packages are indented under it there
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    for name in packages:
        assert re.search(rf"^  {name}/ ", layout, re.M), f"README's layout section does not name fl_geo/{name}/"
        assert f"fl_geo/{name}/" in design, f"docs/design.md's layer list does not name fl_geo/{name}/"


def test_every_name_in_the_algorithms_code_map_exists():
    """docs/algorithms.md says which function implements each rule; a rename must update it."""
    import importlib

    text = (ROOT / "docs" / "algorithms.md").read_text(encoding="utf-8")
    table = text[text.index("## Where each rule lives in the code"):]
    names = re.findall(r"`(fl_geo\.[\w.]+)`", table)
    assert len(names) >= 25
    for dotted in names:
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attr in parts[cut:]:
                assert hasattr(obj, attr), f"docs/algorithms.md names {dotted}, which does not exist"
                obj = getattr(obj, attr)
            break
        else:
            raise AssertionError(f"docs/algorithms.md names {dotted}, which cannot be imported")


def test_the_command_line_and_the_config_schema_import_without_torch():
    """Importing the command line, the config module and schema, the corpus fetcher and the
    deployment topology imports no torch (~3 CPU-s), so `fl-geo --help`, `fl-geo data fetch` and
    the deploy commands that load no run config start in a fraction of a second: the names the
    config accepts live in torch-free modules (`fl_geo.inner.choices`, `fl_geo.inner.model_config`,
    `fl_geo.data.settings`), and `fl_geo.data` imports its members when first used. (Loading a
    config does import torch: a method's settings are defined beside its strategy class.)
    Checked in a fresh interpreter."""
    import subprocess
    import sys

    code = ("import sys; import fl_geo.cli, fl_geo.config, fl_geo.config_schema, fl_geo.data.fetch, "
            "fl_geo.deploy.topology; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout[-2000:] + out.stderr[-2000:]
