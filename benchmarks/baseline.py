"""An earlier revision of this repository's library loaded beside the checkout's, in one process, so
that a change can be compared with the code before it on the same machine at the same moment: host
time (`bench_block.py --host --baseline REV`), a trunk step's kernel time (`bench_trunk.py --baseline
REV`), the attention's (`bench_attention.py --baseline REV`). Hosts and GPUs differ between machine
instances, and drift on one, by more than most single changes move them.

`load(rev)` copies the revision's `evoformer_blocks/`, `csrc/` and `pyproject.toml` out of git
(`git archive`) into a folder of its own (``$EVOFORMER_BLOCKS_BASELINE_DIR``, else the system's temp
folder, one subfolder per commit) and renames there what would collide with the checkout's library:
the Python package (`evoformer_blocks` -> `evoformer_baseline`, which also renames the extension's op
namespace and its JIT build) and, in `csrc/` (the C++ sources and the script that generates some of
them), the namespace `evoformer` (two extensions defining the same inline functions and statics in one
process would share them). It returns the
renamed package, imported; its extension builds on first use, as the checkout's does.
"""

from __future__ import annotations

import importlib
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "evoformer_baseline"
_TEXT_SUFFIXES = (".h", ".cuh", ".cu", ".cpp", ".py", ".toml", ".json")


def _git(*args: str) -> bytes:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True).stdout


def _prepared(folder: Path) -> bool:
    return (folder / PACKAGE / "__init__.py").is_file()


def prepare(rev: str) -> Path:
    """The folder holding revision `rev`'s renamed package and sources (made once per commit). Where
    git cannot resolve `rev` (a copy of the working tree without the repository's history, as on a
    remote GPU machine), a folder prepared elsewhere and copied into the baselines' folder serves when
    exactly one prepared folder's name (the commit's first 12 hex digits) starts with `rev`."""
    root = Path(os.environ.get("EVOFORMER_BLOCKS_BASELINE_DIR", Path(tempfile.gettempdir()) / "evoformer_blocks_baselines"))
    try:
        commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
    except (OSError, subprocess.CalledProcessError) as error:
        found = [f for f in root.glob(f"{rev.lower()[:12]}*") if len(f.name) == 12 and _prepared(f)]
        if len(found) == 1:
            return found[0]
        raise RuntimeError(f"revision {rev!r}: git cannot resolve it here ({error}) and {root} holds "
                           f"{len(found)} prepared folders matching it (one is needed)") from error
    folder = root / commit[:12]
    if _prepared(folder):
        return folder
    staging = root / f"{commit[:12]}.{os.getpid()}"
    with tarfile.open(fileobj=io.BytesIO(_git("archive", "--format=tar", commit, "evoformer_blocks", "csrc",
                                              "pyproject.toml"))) as archive:
        archive.extractall(staging)
    (staging / "evoformer_blocks").rename(staging / PACKAGE)
    namespace = re.compile(r"\bevoformer\b")
    for path in staging.rglob("*"):
        if not path.is_file() or path.suffix not in _TEXT_SUFFIXES:
            continue
        text = path.read_text()
        renamed = text.replace("evoformer_blocks", PACKAGE)
        if staging / "csrc" in path.parents:  # (after the package's name: `evoformer_baseline` has no `\bevoformer\b`)
            renamed = namespace.sub(PACKAGE, renamed)
        if renamed != text:
            path.write_text(renamed)
    try:
        staging.rename(folder)  # (a process preparing the same commit at the same time: the first one's stays)
    except OSError:
        if not _prepared(folder):
            raise
    return folder


def load(rev: str) -> ModuleType:
    """Revision `rev`'s library as the package `evoformer_baseline` (one revision per process)."""
    folder = str(prepare(rev))
    loaded = sys.modules.get(PACKAGE)
    if loaded is not None:
        if not str(Path(loaded.__file__).resolve()).startswith(str(Path(folder).resolve())):
            raise RuntimeError(f"another revision's {PACKAGE} is already loaded: {loaded.__file__}")
        return loaded
    sys.path.insert(0, folder)
    return importlib.import_module(PACKAGE)
