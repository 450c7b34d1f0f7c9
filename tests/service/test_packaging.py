"""The release: ``make dist`` (an sdist, and the wheel pip builds from it) and ``make
formula`` (the Homebrew formula for that sdist) agree, the sdist carries what the formula
installs, and the formula passes what ``brew audit --strict`` checks without brew."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

import mlxceld
from mlxceld.config.daemon import Overrides, load_config

from helpers.daemons import Daemons
from helpers.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
HOMEBREW = ROOT / "packaging" / "homebrew"
SCRIPT = HOMEBREW / "formula.py"
VERSION = mlxceld.__version__
EXAMPLE = ROOT / "contrib" / "mlxceld.toml"
BUILD_TIMEOUT_S = 300
TOOL_TIMEOUT_S = 60
# Where the Homebrew service keeps its files, under $(brew --prefix)/var; mlxctl looks for
# the socket at $(brew --prefix)/var/run/mlxceld/mlxceld.sock.
BREW_VAR = {"state_dir": "lib/mlxceld", "socket": "run/mlxceld/mlxceld.sock",
            "log_file": "log/mlxceld.log"}


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


# -- the service's config file under etc/, its files under var/ ----------------------------


def post_install_settings(text: str) -> dict[str, str]:
    """The ``"key" => var/"path"`` pairs that post_install sets in the config file."""
    body = re.search(r"(?ms)^  def post_install\n(.*?)^  end\n", text)
    assert body, "the formula has no post_install"
    return dict(re.findall(r'^\s+"(\w+)"\s+=> var/"([^"]+)",$', body[1], re.M))


def brew_config(example: str, var: Path) -> str:
    """post_install's substitution, in Python (test_post_install_* run the Ruby itself)."""
    for key, path in BREW_VAR.items():
        assert len(re.findall(rf"(?m)^# {key} = ", example)) == 1, \
            f"contrib/mlxceld.toml needs exactly one '# {key} = ' line for post_install to set"
        example = re.sub(rf"(?m)^# {key} = .*$", f'{key} = "{var / path}"', example, count=1)
    return example


def assert_under_var(config: Path, var: Path) -> None:
    cfg = load_config(Overrides(config_file=config))
    assert (cfg.state_dir, cfg.socket, cfg.log_file) == (
        var / "lib/mlxceld", var / "run/mlxceld/mlxceld.sock", var / "log/mlxceld.log")
    # The rest is the example's.
    assert cfg.cluster_peers == ("192.168.1.11:19000", "192.168.1.12:19000")
    assert cfg.serve.port == 8080


def test_service_reads_the_config_that_post_install_writes(good: str) -> None:
    assert post_install_settings(good) == BREW_VAR
    assert "text.sub!(/^# #{key} = .*$/, " in good  # what brew_config mirrors
    assert 'config = etc/"mlxceld/mlxceld.toml"' in good
    assert 'run [opt_bin/"mlxceld", "--config", etc/"mlxceld/mlxceld.toml"]' in good
    assert 'log_path var/"log/mlxceld.log"' in good  # the daemon's log_file too
    caveats = re.search(r"(?ms)^  def caveats\n(.*?)^  end\n", good)
    assert caveats and "~/Library" not in caveats[1]
    for path in ("#{etc}/mlxceld/mlxceld.toml", *(f"#{{var}}/{p}" for p in BREW_VAR.values())):
        assert path in caveats[1], path


def test_the_example_becomes_a_config_with_state_and_socket_under_var(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("STATE_DIRECTORY", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    var = tmp_path / "var"
    config = tmp_path / "mlxceld.toml"
    config.write_text(brew_config(EXAMPLE.read_text(), var))
    assert_under_var(config, var)


def test_the_daemon_runs_as_brew_services_runs_it(daemons: Daemons) -> None:
    """The service's command line with that config: state, socket and log land under var/,
    and mlxctl reaches the daemon at var/run/mlxceld/mlxceld.sock."""
    d = daemons.make(name="brew")  # a short dir: the socket path has a length limit
    var = d.root / "var"
    d.config.write_text(brew_config(EXAMPLE.read_text(), var))
    (var / "log").mkdir(parents=True)  # post_install's (var/"log").mkpath; brew has var/log
    (var / "run").mkdir(mode=0o755)  # shared by every brew service: ours is a dir inside
    with d.stderr_path.open("ab") as err:
        d.proc = subprocess.Popen([sys.executable, "-m", "mlxceld", "--config", str(d.config)],
                                  stdin=subprocess.DEVNULL, stdout=err, stderr=err)
    socket = var / "run/mlxceld/mlxceld.sock"
    wait_for(lambda: socket.is_socket() or d.proc.poll() is not None, 20,
             f"the control socket {socket}")
    assert d.proc.poll() is None, d.stderr()
    done = subprocess.run([sys.executable, "-m", "mlxctl", "--socket", str(socket), "status",
                           "--json"], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    daemon = json.loads(done.stdout)["daemon"]
    assert (daemon["state_dir"], daemon["socket"]) == (str(var / "lib/mlxceld"), str(socket))
    assert (var / "lib/mlxceld/state.db").is_file()
    assert stat.S_IMODE((var / "run").stat().st_mode) == 0o755  # left as brew made it
    wait_for(lambda: "ready" in (var / "log/mlxceld.log").read_text(), 10,
             "the daemon's log in var/log/mlxceld.log")


# post_install for real: the formula loaded by ruby under a stand-in for brew's Formula
# class, whose DSL records nothing and whose etc, var and pkgshare are a temp dir's.
BREW_STUB = """
require "pathname"

module Language
  module Python
    module Virtualenv; end
  end
end

class Formula
  PREFIX = Pathname(ARGV.fetch(1))
  def self.method_missing(*, **) = nil
  def self.respond_to_missing?(*) = true
  def self.test(*) = nil # Kernel#test would take `test do ... end`
  def etc = PREFIX/"etc"
  def var = PREFIX/"var"
  def pkgshare = PREFIX/"share/mlxceld"
  def odie(message) = abort("Error: #{message}")
end

load ARGV.fetch(0)
Mlxceld.new.post_install
"""


def post_install(good: str, prefix: Path, example: str) -> subprocess.CompletedProcess[str]:
    (prefix / "share/mlxceld/examples").mkdir(parents=True, exist_ok=True)
    (prefix / "share/mlxceld/examples/mlxceld.toml").write_text(example)
    (prefix / "mlxceld.rb").write_text(good)
    (prefix / "brew.rb").write_text(BREW_STUB)
    return subprocess.run(["ruby", str(prefix / "brew.rb"), str(prefix / "mlxceld.rb"),
                           str(prefix)], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)


needs_ruby = pytest.mark.skipif(shutil.which("ruby") is None,
                                reason="ruby is not on PATH; post_install runs where it is")


@needs_ruby
def test_post_install_writes_the_config_once(good: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("STATE_DIRECTORY", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    done = post_install(good, tmp_path, EXAMPLE.read_text())
    assert done.returncode == 0, done.stderr
    config = tmp_path / "etc/mlxceld/mlxceld.toml"
    assert config.read_text() == brew_config(EXAMPLE.read_text(), tmp_path / "var")
    assert_under_var(config, tmp_path / "var")
    assert (tmp_path / "var/log").is_dir()
    # An upgrade runs post_install again: the user's file stays as it is.
    config.write_text("[daemon]\nlog_level = 'debug'\n")
    done = post_install(good, tmp_path, EXAMPLE.read_text())
    assert done.returncode == 0, done.stderr
    assert config.read_text() == "[daemon]\nlog_level = 'debug'\n"


@needs_ruby
def test_post_install_refuses_an_example_without_a_key_to_set(good: str,
                                                               tmp_path: Path) -> None:
    example = EXAMPLE.read_text().replace("# socket = ", "# sock = ")
    done = post_install(good, tmp_path, example)
    assert done.returncode != 0
    assert "has no '# socket = ' line to set" in done.stderr, done.stderr
    assert not (tmp_path / "etc/mlxceld/mlxceld.toml").exists()
