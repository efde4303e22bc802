"""The installable package: a wheel built from this tree, installed into a fresh virtual
environment, carries the kernel sources and finds them there (CPU only, no network)."""

from __future__ import annotations

import email
import os
import shutil
import site as site_module
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from evoformer_blocks.ops import _build

ROOT = Path(__file__).resolve().parents[1]
# What the build reads: pyproject.toml names the readme, the package and csrc/.
PROJECT_FILES = ("pyproject.toml", "README.md", "evoformer_blocks", "csrc")
KERNELS = Path("csrc")


def run(*command, cwd: Path, env: dict = None) -> str:
    result = subprocess.run(
        [str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def relative_files(directory: Path, keep) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and keep(p)}


def is_kernel_source(path: Path) -> bool:
    return path.suffix in _build.SOURCE_SUFFIXES or path.name == "generate.py"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built without network or build isolation from a clean copy of the project (a build
    in the checkout could pick up stale files from an earlier build/)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    source.mkdir()
    for name in PROJECT_FILES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, source / name)
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
        "-w", tmp / "dist", source, cwd=tmp, env=env)
    [built] = (tmp / "dist").glob("evoformer_blocks-*.whl")
    return built


@pytest.mark.slow
def test_wheel_declares_numpy_and_hydra_only_for_the_example(wheel):
    # numpy: torch imports it at startup (and warns on every run without it) but does not require it
    with zipfile.ZipFile(wheel) as archive:
        [name] = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = email.message_from_bytes(archive.read(name))
    requires = metadata.get_all("Requires-Dist")
    core = sorted(r.split(">")[0].split(";")[0].strip() for r in requires if "extra ==" not in r)
    assert core == ["ml-collections", "ninja", "numpy", "torch"]
    assert any(r.startswith("hydra-core") and 'extra == "example"' in r for r in requires)


@pytest.mark.slow
def test_installed_wheel_carries_and_finds_the_kernel_sources(wheel, tmp_path):
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv, cwd=tmp_path)
    python = venv / ("Scripts" if os.name == "nt" else "bin") / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    # pip from the base environment installs into the venv; --ignore-installed leaves any
    # installation of the package in the base environment (e.g. an editable one) alone.
    run(python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", wheel,
        cwd=tmp_path, env=env)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(run(python, "-c", purelib, cwd=tmp_path, env=env).strip())
    assert site.resolve().is_relative_to(venv.resolve())
    # A venv made from inside another venv sees the base interpreter's site-packages, not the
    # parent environment's (where torch is): those directories go after the venv's own.
    (site / "_parent_environment.pth").write_text("\n".join(site_module.getsitepackages()) + "\n")

    outside = tmp_path / "elsewhere"  # not the checkout, so its evoformer_blocks/ is not on sys.path
    outside.mkdir()
    report = dict(
        line.split(maxsplit=1)
        for line in run(python, "-m", "evoformer_blocks.info", cwd=outside, env=env).splitlines()
        if line and not line[0].isspace() and len(line.split(maxsplit=1)) == 2
    )
    package = Path(report["package"].split(" at ", 1)[1])
    assert package == site.resolve() / "evoformer_blocks", report["package"]
    sources = Path(report["sources"].rsplit(" (", 1)[0])
    assert sources == package / "_csrc", report["sources"]
    assert "installed package data" in report["sources"]
    assert f"{len(_build.sources())} files to compile" in report["sources"]  # as many as the checkout's

    # The installed kernel sources are the checkout's, file for file (a new *.json included).
    assert (sources / "attention" / "attention_bindings.cpp").is_file()
    assert len(list((sources / "attention" / "instantiations").glob("*.cu"))) > 0
    assert relative_files(sources, is_kernel_source) == relative_files(ROOT / KERNELS, is_kernel_source)
    for name in relative_files(ROOT / KERNELS, is_kernel_source):
        assert (sources / name).read_bytes() == (ROOT / KERNELS / name).read_bytes(), name
    # And every module of the package (pyproject.toml lists the packages by name).
    python_files = lambda p: p.suffix == ".py"  # noqa: E731
    assert relative_files(ROOT / "evoformer_blocks", python_files) <= relative_files(package, python_files)
