"""The import rule (.importlinter, docs/ARCHITECTURE.md "Import rule") holds, and bites.

The contracts are checked by import-linter's `lint-imports` in a subprocess (it
builds the graph from the source, importing nothing of ferroxmp). The oracle for
"it bites" is a copy of the package with one forbidden arrow added: the run must
fail and name exactly the contract that arrow breaks, with every other one kept.
"""
from __future__ import annotations

import configparser
import os
import pkgutil
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, ".importlinter")
LINT = os.path.join(os.path.dirname(sys.executable), "lint-imports")

ENGINE = "scheduler and gpu_worker never import frontend or router"
FRONTEND = "frontend never imports gpu_worker or scheduler"
RADIX = "radix imports nothing of ferroxmp but the page pool"
ACYCLIC = "no import cycle between sibling modules"


def lint(root: str) -> subprocess.CompletedProcess:
    """lint-imports on the package under `root`. PYTHONPATH puts that copy first (the
    venv's editable install points at the working tree, which must not be the one read)."""
    env = dict(os.environ, PYTHONPATH=root)
    return subprocess.run([LINT, "--no-cache", "--no-logo", os.path.join(root, ".importlinter")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=60)


def verdicts(out: str) -> dict[str, str]:
    """contract name -> KEPT / BROKEN, from lint-imports' summary (a long name may wrap)."""
    m = re.search(r"dependencies\.\s*-+\s*(.*?)\s*Contracts: \d+ kept", out, re.S)
    assert m, out
    text = " ".join(m.group(1).split())
    return {name.strip(): verdict for name, verdict in re.findall(r"(.*?) (KEPT|BROKEN)", text)}


def test_the_import_contracts_hold_on_the_working_tree():
    """Pins: an upward arrow (worker -> frontend, an attention or GGUF import cycle)
    came back into ferroxmp/."""
    run = lint(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    kept = verdicts(run.stdout)
    assert len(kept) >= 10 and set(kept.values()) == {"KEPT"}, run.stdout


@pytest.mark.parametrize("module,line,contract", [
    ("scheduler/policy.py", "import ferroxmp.frontend.app", ENGINE),
    ("gpu_worker/sampling/grammar.py", "from ferroxmp.frontend.text.tokenizer import TextCodec", ENGINE),
    ("frontend/state.py", "import ferroxmp.scheduler.core", FRONTEND),
    ("radix/tree.py", "import ferroxmp.config", RADIX),
    ("gpu_worker/kv/pool.py", "from ferroxmp.gpu_worker import runner", ACYCLIC),
    ("checkpoint/gguf_weights.py", "from . import gguf_config", ACYCLIC),
], ids=["scheduler-imports-frontend", "worker-imports-frontend-tokenizer", "frontend-imports-scheduler",
        "radix-imports-config", "kv-runner-cycle", "gguf-cycle"])
def test_one_forbidden_import_breaks_exactly_its_contract(tmp_path, module, line, contract):
    """Pins: contracts that pass whatever the code does (a wrong module name, a
    contract type that checks nothing, the linter reading the working tree instead
    of the copy)."""
    shutil.copytree(os.path.join(ROOT, "ferroxmp"), tmp_path / "ferroxmp",
                    ignore=shutil.ignore_patterns("__pycache__", "static"))
    shutil.copy(CONFIG, tmp_path / ".importlinter")
    target = tmp_path / "ferroxmp" / module
    target.write_text(target.read_text() + f"\n{line}  # the forbidden arrow\n")
    run = lint(str(tmp_path))
    assert run.returncode != 0, run.stdout
    got = verdicts(run.stdout)
    assert got.pop(contract) == "BROKEN", run.stdout
    assert got and set(got.values()) == {"KEPT"}, run.stdout
    parts = module.removesuffix(".py").split("/")
    if contract == ACYCLIC:  # the cycle is reported between siblings: the importer's package or itself
        assert re.search(rf"- \.({'|'.join(parts[1:])}) -> |-> \.({'|'.join(parts[1:])}) ", run.stdout), run.stdout
    else:
        assert re.search(rf"\.{parts[-1]} ->", run.stdout), run.stdout  # the report names the importer


@pytest.mark.parametrize("contract,allowed", [("radix", {"ferroxmp.radix", "ferroxmp.page_pool"}),
                                              ("page-pool", {"ferroxmp.page_pool"})])
def test_the_bottom_contracts_forbid_every_other_top_level_module(contract, allowed):
    """Pins: a module added to ferroxmp/ that radix or the page pool could import
    unnoticed, because a forbidden contract lists modules by name."""
    cfg = configparser.ConfigParser()
    cfg.read(CONFIG)
    forbidden = set(cfg[f"importlinter:contract:{contract}"]["forbidden_modules"].split())
    package = os.path.join(ROOT, "ferroxmp")
    top = {f"ferroxmp.{m.name}" for m in pkgutil.iter_modules([package])} - allowed
    assert top and forbidden == top


def test_every_module_opens_with_its_job():
    """Pins: a module without its opening docstring (issue 27: each module's opening says
    its one job). The oracle is the parsed source, not a name list."""
    import ast
    import pathlib
    missing = [str(p.relative_to(ROOT)) for p in sorted((pathlib.Path(ROOT) / "ferroxmp").rglob("*.py"))
               if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, missing
