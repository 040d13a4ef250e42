"""No dead code in the product (issue 27): vulture over the package, with the tests and
tools counting as users, and `tools/vulture_allow.py` listing the uses vulture cannot
see (through strings, other libraries, protocols), each with its reason."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Flask routes and hooks are called by the framework, never by name.
DECORATORS = "@app.*,@*.route,@*.get,@*.post,@*.delete,@*.errorhandler,@*.before_request,@*.after_request"


def vulture(*extra: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "vulture", "ferroxmp", "tests", "tools", *extra,
                          "--min-confidence", "60", "--ignore-decorators", DECORATORS],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode in (0, 3), out.stderr  # 3: dead code found
    return [line for line in out.stdout.splitlines() if line.strip()]


def test_the_package_has_no_code_nothing_uses(tmp_path):
    planted = tmp_path / "ferroxmp_planted.py"
    planted.write_text("def a_function_nobody_calls():\n    return 1\n")
    found = vulture(str(planted))
    product = [line for line in found if line.startswith("ferroxmp" + os.sep)]
    assert product == [], "dead code (delete it, or list a real use in tools/vulture_allow.py):\n" + "\n".join(product)
    assert any("a_function_nobody_calls" in line for line in found), "the check must see a planted dead function"


def test_the_allow_list_names_only_what_exists(tmp_path):
    """An entry for a name that no longer exists would hide nothing and mislead: vulture
    run without the allow list must report each of its product names."""
    copy = tmp_path / "repo"
    for part in ("ferroxmp", "tests", "tools"):
        shutil.copytree(os.path.join(ROOT, part), copy / part,
                        ignore=shutil.ignore_patterns("__pycache__", "vulture_allow.py"))
    out = subprocess.run([sys.executable, "-m", "vulture", "ferroxmp", "tests", "tools", "--min-confidence", "60",
                          "--ignore-decorators", DECORATORS], cwd=copy, capture_output=True, text=True, timeout=120)
    reported = out.stdout
    allow = open(os.path.join(ROOT, "tools", "vulture_allow.py"), encoding="utf-8").read()
    for name in ("pre_tokenizer", "tags", "disable_overlap", "metrics_public", "reasoning_parser", "bos_token_id",
                 "special_token_ids", "generation_tokens", "worker_busy_seconds", "step_token_budget",
                 "kv_hit_tokens_pool", "rtype"):
        assert name in allow
        assert f"'{name}'" in reported, f"{name} is in the allow list but vulture does not report it any more"
