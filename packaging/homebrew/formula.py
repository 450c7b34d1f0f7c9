"""Write the Homebrew formula for a built sdist (``make formula``)::

    python packaging/homebrew/formula.py dist/mlxceld-0.1.0.tar.gz [--output FILE]

The formula is ``mlxceld.rb.in`` with the sdist's version and sha256 put in; its url is
where the release publishes that very file (the GitHub release asset, not the tag's
archive, whose bytes differ). The same sdist always gives the same formula.

Nothing is written, and the exit status is 1, when the sdist lacks a file the formula's
``install`` takes from the unpacked tree, or when the formula fails one of the checks of
``brew audit --strict`` that need no brew (``audit``). ``ruby -c`` is the test's.
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import re
import sys
import tarfile
import tomllib
from pathlib import Path

from packaging.licenses import InvalidLicenseExpression, canonicalize_license_expression

NAME = "mlxceld"
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TEMPLATE = HERE / f"{NAME}.rb.in"
FORMULA = HERE / f"{NAME}.rb"
GENERATED = ("Written by `make formula` (packaging/homebrew/formula.py) from mlxceld.rb.in: "
             "edit that.")
# pip builds and installs the unpacked tree: the project, its readme and its license.
BUILT_FROM = ("pyproject.toml", "README.md", "LICENSE", f"{NAME}/__init__.py", "mlxctl/__init__.py")
MAX_DESC = 80  # brew's DescHelper::MAX_DESC_LENGTH
LOWERCASE_STARTS = {"iOS", "iPhone", "macOS"}  # brew's VALID_LOWERCASE_WORDS


class FormulaError(Exception):
    """The sdist or the formula is not fit to release; the message says why."""


# -- the sdist -----------------------------------------------------------------------------


def sdist_contents(sdist: Path) -> tuple[str, set[str]]:
    """The version in the sdist's PKG-INFO, and its files relative to its top directory."""
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            names = tar.getnames()
            top = names[0].split("/")[0] if names else ""
            info = tar.extractfile(f"{top}/PKG-INFO") if f"{top}/PKG-INFO" in names else None
            pkg_info = info.read().decode() if info else ""
    except (OSError, tarfile.TarError) as exc:
        raise FormulaError(f"cannot read sdist {sdist}: {exc}; build it with: make dist") \
            from exc
    version = email.parser.Parser().parsestr(pkg_info).get("Version")
    if not version:
        raise FormulaError(f"{sdist} has no {top}/PKG-INFO with a Version; is it an sdist? "
                           "build one with: make dist")
    if top != f"{NAME}-{version}" or sdist.name != f"{top}.tar.gz":
        raise FormulaError(f"{sdist}: expected {NAME}-{version}.tar.gz unpacking into "
                           f"{NAME}-{version}/ (its PKG-INFO says {version}), got {top}/")
    prefix = f"{top}/"
    return version, {n[len(prefix):] for n in names if n.startswith(prefix)}


def installed_from_tree(template: str) -> list[str]:
    """What the formula takes from the unpacked sdist: every ``X.install "path", ...``
    argument, and what pip needs to build it."""
    paths = [p for line in re.findall(r"(?m)^\s+\S+\.install (.+)$", template)
             for p in re.findall(r'"([^"]+)"', line)]
    return [*BUILT_FROM, *paths]


def missing_from(files: set[str], wanted: list[str]) -> list[str]:
    """The paths of ``wanted`` that are neither a file nor a directory in ``files``."""
    return [w for w in wanted if w not in files and not any(f.startswith(f"{w}/") for f in files)]


# -- the formula ---------------------------------------------------------------------------


def render(template: str, version: str, sha256: str) -> str:
    text = (template.replace("@GENERATED@", GENERATED).replace("@VERSION@", version)
            .replace("@SHA256@", sha256))
    left = sorted(set(re.findall(r"@[A-Z0-9_]+@", text)))
    if left:
        raise FormulaError(f"{TEMPLATE.name} has placeholders formula.py does not fill: {left}")
    return text


def _stanza(text: str, name: str) -> str | None:
    """The string argument of a top-level stanza (``  desc "..."``), or None."""
    found = re.search(rf'(?m)^  {name} "([^"]*)"', text)
    return found[1] if found else None


def _audit_desc(desc: str | None) -> list[str]:
    if desc is None:
        return ["formula has no desc"]
    out = []
    if not desc.strip():
        out.append("desc is empty")
    if desc != desc.strip():
        out.append("desc has leading or trailing spaces")
    if len(desc) > MAX_DESC:
        out.append(f"desc is {len(desc)} characters, more than {MAX_DESC}")
    if re.match(r"(?i)(the|an?)\s", desc):
        out.append("desc starts with an article")
    if desc[:1].islower() and desc.split()[0] not in LOWERCASE_STARTS:
        out.append("desc does not start with a capital letter")
    if re.match(r"(?i)" + r"[\s-]?".join(NAME) + r"\b", desc):
        out.append("desc starts with the formula name")
    if desc.endswith(".") and not desc.endswith("etc."):
        out.append("desc ends with a full stop")
    if re.search(r"(?i)command ?line", desc):
        out.append('desc should say "command-line"')
    return out


def audit(text: str, *, version: str, license: str) -> list[str]:
    """The checks of ``brew audit --strict`` that need no brew, one line per problem."""
    out = _audit_desc(_stanza(text, "desc"))
    homepage = _stanza(text, "homepage")
    if not (homepage or "").startswith("https://"):
        out.append(f"homepage {homepage!r} is not an https URL")
    formula_license = _stanza(text, "license")
    try:
        canonical = canonicalize_license_expression(formula_license or "")
    except InvalidLicenseExpression:
        out.append(f"license {formula_license!r} is not an SPDX license expression")
    else:
        if canonical != canonicalize_license_expression(license):
            out.append(f"license {formula_license!r} is not pyproject.toml's {license!r}")
    url = _stanza(text, "url") or ""
    if not url.startswith("https://"):
        out.append(f"url {url!r} is not https")
    if not url.endswith(f"/{NAME}-{version}.tar.gz"):
        out.append(f"url {url!r} does not end in {NAME}-{version}.tar.gz (brew reads the "
                   "version from it)")
    if not re.fullmatch(r"[0-9a-f]{64}", _stanza(text, "sha256") or ""):
        out.append("sha256 is not 64 lowercase hex digits")
    if re.search(r"(?m)^  version ", text):
        out.append("version is given explicitly; brew derives it from the url")
    for block in ("install", "service", "test"):
        if not re.search(rf"(?m)^  (def {block}|{block} do)$", text):
            out.append(f"formula has no {block} block")
    return out


# -- the command ---------------------------------------------------------------------------


def project_license() -> str:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return str(tomllib.load(f)["project"]["license"])


def formula_for(sdist: Path) -> str:
    """The formula text for ``sdist``, checked; FormulaError says what is wrong."""
    version, files = sdist_contents(sdist)
    template = TEMPLATE.read_text()
    missing = missing_from(files, installed_from_tree(template))
    if missing:
        raise FormulaError(f"{sdist} lacks {', '.join(missing)}, which the formula installs "
                           "from it: add them to MANIFEST.in and run make dist again")
    with sdist.open("rb") as f:
        sha256 = hashlib.file_digest(f, "sha256").hexdigest()
    text = render(template, version, sha256)
    problems = audit(text, version=version, license=project_license())
    if problems:
        raise FormulaError(f"the formula from {TEMPLATE.name} fails brew audit's checks:\n  "
                           + "\n  ".join(problems))
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="formula.py", description=__doc__.split("::")[0])
    parser.add_argument("sdist", type=Path, help="the sdist, dist/mlxceld-VERSION.tar.gz")
    parser.add_argument("--output", "-o", type=Path, default=FORMULA,
                        help=f"where to write the formula (default: {FORMULA.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    try:
        text = formula_for(args.sdist)
    except FormulaError as exc:
        print(f"formula.py: {exc}", file=sys.stderr)
        return 1
    args.output.write_text(text)
    print(f"wrote {args.output} for {args.sdist.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
