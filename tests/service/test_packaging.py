"""The release: ``make dist`` (an sdist, and the wheel pip builds from it) and ``make
formula`` (the Homebrew formula for that sdist) agree, the sdist carries what the formula
installs, and the formula passes what ``brew audit --strict`` checks without brew."""

from __future__ import annotations

import hashlib
import importlib.util
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

import mlxceld

ROOT = Path(__file__).resolve().parents[2]
HOMEBREW = ROOT / "packaging" / "homebrew"
SCRIPT = HOMEBREW / "formula.py"
VERSION = mlxceld.__version__
BUILD_TIMEOUT_S = 300
TOOL_TIMEOUT_S = 60


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("homebrew_formula", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


formula = load_script()


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What ``make dist`` builds: the sdist, then the wheel from the unpacked sdist."""
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "build", "--quiet", "--no-isolation",
                           "--outdir", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.fixture(scope="module")
def sdist(dist: Path) -> Path:
    path = dist / f"mlxceld-{VERSION}.tar.gz"
    assert path.is_file(), f"no {path.name} in {sorted(p.name for p in dist.iterdir())}"
    return path


def sdist_names(path: Path) -> set[str]:
    with tarfile.open(path) as tar:
        return {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}


def write_formula(sdist: Path, output: Path) -> subprocess.CompletedProcess[str]:
    """``make formula``'s command."""
    return subprocess.run([sys.executable, str(SCRIPT), str(sdist), "--output", str(output)],
                          capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)


def stanza(text: str, name: str) -> str:
    found = re.search(rf'(?m)^  {name} "([^"]*)"$', text)
    assert found, f"no {name} in the formula"
    return found[1]


# -- the sdist and the wheel ---------------------------------------------------------------


def test_sdist_carries_what_the_formula_installs(sdist: Path) -> None:
    names = sdist_names(sdist)
    wanted = formula.installed_from_tree((HOMEBREW / "mlxceld.rb.in").read_text())
    # The parse found the formula's install lines (it could find nothing and pass).
    assert {"man/mlxceld.8", "man/mlxctl.1", "man/mlxcel-cluster.toml.5",
            "contrib/mlxceld.toml", "contrib/cluster", "LICENSE", "README.md"} <= set(wanted)
    assert formula.missing_from(names, wanted) == [], sorted(names)
    assert {"contrib/cluster/three-hosts.toml", "contrib/systemd/mlxceld.service"} <= names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    assert not [n for n in names if n.startswith("tests/")]


def test_missing_from_names_what_is_absent() -> None:
    files = {"man/mlxceld.8", "contrib/cluster/a.toml", "LICENSE"}
    assert formula.missing_from(files, ["man/mlxceld.8", "contrib/cluster", "contrib/x",
                                        "README.md"]) == ["contrib/x", "README.md"]


def test_wheel_built_from_the_sdist_has_the_man_pages_and_the_license(dist: Path) -> None:
    [wheel] = dist.glob(f"mlxceld-{VERSION}-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        metadata = z.read(f"mlxceld-{VERSION}.dist-info/METADATA").decode()
    data = f"mlxceld-{VERSION}.data/data/share/man"
    assert {f"{data}/man1/mlxctl.1", f"{data}/man5/mlxcel-cluster.toml.5",
            f"{data}/man8/mlxceld.8", f"mlxceld-{VERSION}.dist-info/licenses/LICENSE"} <= names
    assert "License-Expression: MIT" in metadata
    assert "Requires-Dist: h11>=0.16" in metadata


# -- the formula ---------------------------------------------------------------------------


def test_formula_agrees_with_the_sdist_and_is_the_same_twice(sdist: Path,
                                                              tmp_path: Path) -> None:
    first, second = tmp_path / "first.rb", tmp_path / "second.rb"
    for out in (first, second):
        done = write_formula(sdist, out)
        assert done.returncode == 0, done.stderr
    assert first.read_bytes() == second.read_bytes()
    text = first.read_text()
    assert stanza(text, "url") == ("https://github.com/mlxceld/mlxceld/releases/download/"
                                   f"v{VERSION}/mlxceld-{VERSION}.tar.gz")
    assert stanza(text, "sha256") == hashlib.sha256(sdist.read_bytes()).hexdigest()
    with tarfile.open(sdist) as tar:
        info = tar.extractfile(f"mlxceld-{VERSION}/PKG-INFO")
        assert info and f"\nVersion: {VERSION}\n" in info.read().decode()
    assert formula.audit(text, version=VERSION, license="MIT") == []


def test_committed_formula_is_the_template_for_this_version() -> None:
    """packaging/homebrew/mlxceld.rb is mlxceld.rb.in rendered for mlxceld.__version__
    (its sha256 is that of the sdist built when it was written: sdists carry mtimes)."""
    committed = (HOMEBREW / "mlxceld.rb").read_text()
    rendered = formula.render((HOMEBREW / "mlxceld.rb.in").read_text(), VERSION,
                              stanza(committed, "sha256"))
    assert committed == rendered, (
        f"packaging/homebrew/mlxceld.rb is not mlxceld.rb.in rendered for {VERSION}: "
        "edit the template and run make formula")
    assert formula.audit(committed, version=VERSION, license="MIT") == []


def test_formula_script_refuses_an_sdist_without_the_man_pages(sdist: Path,
                                                               tmp_path: Path) -> None:
    bad = tmp_path / sdist.name
    with tarfile.open(sdist) as src, tarfile.open(bad, "w:gz") as dst:
        for member in src.getmembers():
            if "/man/" not in member.name and not member.name.endswith("/man"):
                dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    out = tmp_path / "mlxceld.rb"
    done = write_formula(bad, out)
    assert done.returncode == 1
    assert "lacks man/mlxctl.1, man/mlxcel-cluster.toml.5, man/mlxceld.8" in done.stderr
    assert "MANIFEST.in" in done.stderr
    assert not out.exists()


def test_formula_script_refuses_a_file_that_is_not_an_sdist(tmp_path: Path) -> None:
    bad = tmp_path / f"mlxceld-{VERSION}.tar.gz"
    bad.write_bytes(b"not a tarball")
    done = write_formula(bad, tmp_path / "mlxceld.rb")
    assert done.returncode == 1
    assert f"cannot read sdist {bad}" in done.stderr and "make dist" in done.stderr


@pytest.fixture(scope="module")
def good() -> str:
    return formula.render((HOMEBREW / "mlxceld.rb.in").read_text(), VERSION, "0" * 64)


DESC = stanza((HOMEBREW / "mlxceld.rb.in").read_text(), "desc")
FAULTS = {
    "long desc": (f'desc "{DESC}"', f'desc "{DESC:<81}x"', "more than 80"),
    "article": (f'desc "{DESC}"', 'desc "A daemon"', "starts with an article"),
    "name first": (f'desc "{DESC}"', 'desc "MLXceld runs models"', "formula name"),
    "lowercase": (f'desc "{DESC}"', 'desc "runs models"', "capital letter"),
    "full stop": (f'desc "{DESC}"', f'desc "{DESC}."', "full stop"),
    "no desc": (f'  desc "{DESC}"\n', "", "no desc"),
    "bad license": ('license "MIT"', 'license "MIT License"', "not an SPDX"),
    "other license": ('license "MIT"', 'license "Apache-2.0"', "not pyproject.toml's"),
    "http url": ('url "https://', 'url "http://', "is not https"),
    "other version": (f"mlxceld-{VERSION}.tar.gz", "mlxceld-9.9.tar.gz", "does not end in"),
    "bad sha256": ("0" * 64, "A" * 64, "64 lowercase hex"),
    "explicit version": ('  license "MIT"\n', f'  license "MIT"\n  version "{VERSION}"\n',
                         "version is given explicitly"),
    "no service": ("  service do\n", "  def service_off\n", "no service block"),
    "no test": ("  test do\n", "  def test_off\n", "no test block"),
}


@pytest.mark.parametrize("fault", FAULTS, ids=list(FAULTS))
def test_audit_reports_each_fault(good: str, fault: str) -> None:
    old, new, message = FAULTS[fault]
    assert old in good, f"the fault {fault!r} no longer applies to the template"
    problems = formula.audit(good.replace(old, new, 1), version=VERSION, license="MIT")
    assert any(message in p for p in problems), problems


@pytest.mark.skipif(shutil.which("ruby") is None,
                    reason="ruby is not on PATH; the formula's Ruby syntax is checked where it is")
def test_formula_is_valid_ruby(sdist: Path, tmp_path: Path) -> None:
    rendered = tmp_path / "mlxceld.rb"
    assert write_formula(sdist, rendered).returncode == 0
    for path in (rendered, HOMEBREW / "mlxceld.rb"):
        done = subprocess.run(["ruby", "-c", str(path)], capture_output=True, text=True,
                              timeout=TOOL_TIMEOUT_S)
        assert done.returncode == 0 and "Syntax OK" in done.stdout, done.stderr
