"""benchmarks/baseline.py: a git revision of the library loaded beside the checkout's under another name
(the A/Bs of `bench_block.py --host --baseline REV`, `bench_trunk.py --baseline REV` and
`bench_attention.py --baseline REV`). CPU only: the renamed package imports,
nothing of the checkout's names is left where two libraries in one process would collide, and its
EvoformerBlock takes the checkout's weights."""

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import re, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
import baseline
import evoformer_blocks as ours
library = baseline.load("HEAD")
assert library.__name__ == "evoformer_baseline", library.__name__
folder = Path(library.__file__).resolve().parents[1]
assert not str(folder).startswith(str(Path.cwd().resolve())), folder
from evoformer_baseline.ops import _build
assert _build.OP_NAMESPACE == "evoformer_baseline_cuda", _build.OP_NAMESPACE
assert _build.SOURCE_DIR.resolve() == (folder / "csrc").resolve(), _build.SOURCE_DIR
left = [str(p) for p in (folder / "csrc").rglob("*") if p.is_file()
        and re.search(r"\bevoformer\b|evoformer_blocks", p.read_text())]
assert not left, left
left = [str(p) for p in (folder / "evoformer_baseline").rglob("*.py") if "evoformer_blocks" in p.read_text()]
assert not left, left
args = dict(c_m=32, c_z=16, c_hidden_msa_att=8, c_hidden_opm=4, c_hidden_mul=16, c_hidden_pair_att=8,
            no_heads_msa=2, no_heads_pair=2)
theirs = library.EvoformerBlock(**args)
theirs.load_state_dict(ours.EvoformerBlock(**args).state_dict(), strict=True)
assert baseline.load("HEAD") is library
print("ok")
"""


def test_baseline_loads_a_revision_beside_the_package(tmp_path, run_beside_baseline):
    run_beside_baseline(SCRIPT)
    prepared = [p.name for p in tmp_path.iterdir()]
    assert len(prepared) == 1 and re.fullmatch(r"[0-9a-f]{12}", prepared[0]), prepared


def test_baseline_prepared_folder_serves_without_git(tmp_path, monkeypatch):
    """Where git cannot resolve the revision (a copy of the working tree without history), a folder
    prepared elsewhere serves when exactly one prepared folder's name starts with the revision."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import baseline
    finally:
        sys.path.remove(str(REPO / "benchmarks"))

    def no_git(*args):
        raise OSError("git: not found")

    monkeypatch.setattr(baseline, "_git", no_git)
    monkeypatch.setenv("EVOFORMER_BLOCKS_BASELINE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="0 prepared folders"):
        baseline.prepare("abcdef1")
    for name in ("abcdef123456", "abcdef999999"):
        (tmp_path / name / baseline.PACKAGE).mkdir(parents=True)
        (tmp_path / name / baseline.PACKAGE / "__init__.py").write_text("")
    (tmp_path / "abcdef123456.77").mkdir()  # (a staging folder, never a match)
    assert baseline.prepare("abcdef1234") == tmp_path / "abcdef123456"
    with pytest.raises(RuntimeError, match="2 prepared folders"):
        baseline.prepare("abcdef")
