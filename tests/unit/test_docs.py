"""The README is a front page and docs/ the reference: every page reachable from the README,
every relative link resolving, and the reference pages naming every setting and every
command-line option the code has, so neither drifts from the code unnoticed."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from perfloop import settings as settings_mod
from perfloop.cli.parser import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(page: Path) -> list[str]:
    """The page's Markdown link targets that point into the repository (no URL, no anchor)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0])
    return out


def test_the_readme_is_a_front_page() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_every_reference_page_is_linked_from_the_readme() -> None:
    linked = {(ROOT / t).resolve() for t in relative_links(ROOT / "README.md")}
    missing = [p.name for p in DOCS.glob("*.md") if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    broken = [t for t in relative_links(page) if not (page.parent / t).exists()]
    assert not broken, f"{page.name}: links to nothing: {broken}"


def env_names() -> set[str]:
    """Every ``PERFLOOP_`` variable some service's settings class reads."""
    names: set[str] = set()
    for cls_name in settings_mod.__all__:
        cls = getattr(settings_mod, cls_name)
        if not (isinstance(cls, type) and issubclass(cls, settings_mod.BaseServiceSettings)):
            continue
        prefix = cls.model_config.get("env_prefix", "")
        for name, field in cls.model_fields.items():
            alias = field.validation_alias if isinstance(field.validation_alias, str) else None
            names.add((alias or f"{prefix}{name}").upper())
    return names


def test_every_setting_is_in_the_settings_reference() -> None:
    names = env_names()
    assert len(names) > 30  # the walk found the settings classes
    text = (DOCS / "settings.md").read_text()
    missing = sorted(n for n in names if f"`{n}`" not in text)
    assert not missing, f"docs/settings.md does not list: {missing}"


def long_options(parser: argparse.ArgumentParser, path: str = "") -> dict[str, set[str]]:
    """Each (sub)command's long options, by the command's words (``config set``)."""
    out: dict[str, set[str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for word, sub in action.choices.items():
                out.update(long_options(sub, f"{path} {word}".strip()))
        else:
            opts = {o for o in action.option_strings if o.startswith("--") and o != "--help"}
            if opts and path:
                out.setdefault(path, set()).update(opts)
    return out


def test_every_command_line_option_is_in_the_cli_reference() -> None:
    options = long_options(build_parser())
    assert "run" in options and "--tier" in options["run"]  # the walk reached the commands
    text = (DOCS / "cli.md").read_text()
    missing = sorted(
        f"{cmd} {opt}" for cmd, opts in options.items() for opt in opts if opt not in text
    )
    assert not missing, f"docs/cli.md does not mention: {missing}"
