"""The README's main command as a new user runs it: a fresh clone, a non-editable install,
`edgespec demo` from the clone's root (where the source folder must not shadow the installed
package: node processes run `python -m edgespec`, which puts the working directory first on
the import path), and the README's Python example from the same folder.

To keep the default run short, the new virtualenv reuses this one's already-built
dependencies (llama-cpp-python takes minutes to compile) through a path entry, and installs
edgespec itself from the clone with `pip install --no-deps .`, which builds the C++ core anew.
`.ci/run` also runs the README command verbatim after the tests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.real_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def clone(tmp_path_factory, real_model_path) -> tuple[Path, Path]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout")
    root = tmp_path_factory.mktemp("fresh") / "edgespec"
    subprocess.run(["git", "clone", "-q", str(REPO), str(root)], check=True, timeout=120)
    # The working tree as it is now (tests run before a commit too), minus build outputs.
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard"],
                             capture_output=True, text=True, check=True).stdout.split()
    for rel in tracked:
        src = REPO / rel
        if src.is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / rel)
    venv = root / ".venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # A plain path line: the dependencies of this environment, but not its .pth hooks (the
    # editable install of edgespec stays out of the new environment).
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                          "--no-deps", "."], cwd=root, capture_output=True, text=True,
                         timeout=900)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    return root, venv


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_WAIT_POLICY="passive")
    env.pop("PYTHONPATH", None)
    return env


def test_readme_main_command_from_the_clone_root(clone):
    root, venv = clone
    proc = subprocess.run([str(venv / "bin" / "edgespec"), "demo", "--max-tokens", "16"],
                          cwd=root, capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tokens/s" in proc.stdout and '"tokens": 16' in proc.stdout, proc.stdout
    assert "ImportError" not in proc.stderr


def test_readme_python_example_from_the_clone_root(clone):
    root, venv = clone
    script = ("import edgespec\n"
              "from edgespec import Ring\n"
              "with Ring.local('qwen2.5-coder-0.5b', stages=2) as ring:\n"
              "    out = ring.generate('def fibonacci(n):', max_tokens=8)\n"
              "    print(out.stats.tokens, edgespec.__file__)\n")
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", script], cwd=root,
                          capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tokens, where = proc.stdout.split()[-2:]
    assert tokens == "8", proc.stdout
    assert where.startswith(str(venv)), where  # the installed copy, not the clone's source


def test_a_source_tree_without_the_core_says_what_to_do(clone, tmp_path):
    _root, venv = clone  # an environment without this checkout's editable import hook
    shutil.copytree(REPO / "src" / "edgespec", tmp_path / "edgespec",
                    ignore=shutil.ignore_patterns("_core*", "__pycache__"))
    proc = subprocess.run([str(venv / "bin" / "python"), "-I", "-c",
                           "import sys; sys.path.insert(0, '.'); import edgespec.tree.core"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, env=_env())
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "C++ core is not built" in last and "pip install ." in last, proc.stderr
