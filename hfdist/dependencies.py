"""hfdist's dependency floors, checked when hfdist is imported.

The floors live in hfdist/requirements/base.txt, one requirement per line with why after a `#` (pyproject.toml reads
the same file for the package's metadata): each is the release CI installs and tests (scripts/setup.sh installs
exactly the floors under HFDIST_FLOORS=1, as .ci/run does), so an older one is untested, and most fail in ways far
from their cause (a missing DCP stager, an unknown Trainer argument). `check` refuses such an environment at
`import hfdist` with one paragraph naming what it found and what it needs. It reads installed versions from the
packages' metadata, importing none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from hfdist.errors import HfdistError

__all__ = ["REQUIREMENTS", "Requirement", "DependencyError", "requirements", "unmet", "check"]

REQUIREMENTS = Path(__file__).parent / "requirements" / "base.txt"
TESTED = "the release hfdist is tested with"


class DependencyError(HfdistError, ImportError):
    """An installed dependency outside the versions hfdist needs (or none installed)."""


@dataclass(frozen=True)
class Requirement:
    """One line of a requirements file: the distribution, its version specifier and why (the line's comment)."""

    name: str
    specifier: str
    reason: str

    def admits(self, version: str) -> bool:
        """Whether `version` satisfies the specifier (pre-releases and local builds such as 2.13.0+cpu count)."""
        from packaging.specifiers import SpecifierSet

        return SpecifierSet(self.specifier).contains(version, prereleases=True)


def requirements(path: Path = REQUIREMENTS) -> list[Requirement]:
    """The requirements of a requirements file (comment lines and blank ones skipped)."""
    from packaging.requirements import Requirement as Parsed

    found = []
    for line in path.read_text().splitlines():
        text, _, comment = line.partition("#")
        if text.strip():
            parsed = Parsed(text.strip())
            found.append(Requirement(parsed.name, str(parsed.specifier), comment.strip() or TESTED))
    return found


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def unmet(version_of: Callable[[str], str | None] = _installed,
          path: Path = REQUIREMENTS) -> list[tuple[Requirement, str | None]]:
    """(requirement, the version installed or None) for every requirement the environment does not meet."""
    out = []
    for req in requirements(path):
        found = version_of(req.name)
        if found is None or not req.admits(found):
            out.append((req, found))
    return out


def check(version_of: Callable[[str], str | None] = _installed, path: Path = REQUIREMENTS) -> None:
    """Refuse an environment whose dependencies are outside hfdist's floors (and bounds).

    Raises:
        DependencyError: one paragraph: each unmet requirement with the version found and why it is needed, and the
            command that installs what hfdist needs.
    """
    missing = unmet(version_of, path)
    if not missing:
        return
    what = "; ".join(f"{req.name}{req.specifier} ({req.reason}), and this environment has "
                     f"{f'{req.name} {found}' if found else f'no {req.name}'}" for req, found in missing)
    fix = " ".join(f"'{req.name}{req.specifier}'" for req, _ in missing)
    torch = " (torch: the build for your CUDA from pytorch.org)" if any(r.name == "torch" for r, _ in missing) else ""
    raise DependencyError(
        f"hfdist needs {what}. Install what it needs: pip install {fix}{torch}; or use the environment "
        "scripts/setup.sh builds, which installs every dependency at the version hfdist is tested with.")
