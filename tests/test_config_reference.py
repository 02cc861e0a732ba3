"""docs/config.md is what the generator writes from the config dataclasses and the
comments of configs/default.toml."""

import dataclasses
import typing
from typing import Any, cast

from conftest import ROOT
from conftest import run_cli as towerrec

from towerrec.config import Config
from towerrec.config.reference import _parse_defaults, config_reference

DEFAULT_TOML = ROOT / "configs" / "default.toml"
PAGE = ROOT / "docs" / "config.md"
FIX = "run `towerrec config reference --out docs/config.md` from the repository root"


def _leaf_keys(cls: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    keys: list[str] = []
    for f in dataclasses.fields(cls):
        hint: Any = hints[f.name]
        if dataclasses.is_dataclass(hint):
            keys += _leaf_keys(cast(type, hint), f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def test_docs_config_md_is_the_generated_reference():
    assert PAGE.read_text(encoding="utf-8") == config_reference(DEFAULT_TOML.read_text()), (
        f"docs/config.md is not what the config dataclasses and configs/default.toml give: {FIX}"
    )


def test_every_key_is_listed_with_its_default_and_comment():
    page = config_reference(DEFAULT_TOML.read_text())
    rows = {
        line.split("|")[1].strip().strip("`"): line for line in page.splitlines() if "| `" in line
    }
    for key in _leaf_keys(Config):
        if key == "embedding.tables":  # one section per table, its keys listed apart
            continue
        assert key in rows, key
        meaning = rows[key].split(" | ", 4)[-1].removesuffix(" |")
        assert meaning.strip(), f"{key} has no comment in configs/default.toml"
    assert "| `train.batch_size` | `2048` |  | global batch |" in page
    assert "| `train.steps` | unset | yes | unset = 2500 on the synthetic data" in page
    assert "| `embedding.tables.<table>.memory` | `embedding.memory` | yes |" in page
    assert "| `loss.class_prior` | unset |  |" in page and "(e.g. `0.3`)" in page
    assert "synthetic \\| movielens" in page  # pipes escaped inside the table


def test_comment_continuations_and_section_notes():
    text = "[a]  # the a section\n# a note\n\nx = 1  # first line\n    # second line\n"
    text += "# y: how y works\n# y = 2\n# Entries:\n# [a.tables.t1]\n# z = 3  # per entry\n"
    page = config_reference(DEFAULT_TOML.read_text())
    assert "plateau: x plateau_factor after plateau_patience validations" in page
    sections = _parse_defaults(text)
    assert sections["a"].notes == ["the a section", "a note"]
    assert sections["a"].comments == {"x": "first line second line", "y": "how y works"}
    assert sections["a"].examples == {"y": "2"}
    assert sections["a.tables.<table>"].notes == ["Entries."]
    assert sections["a.tables.<table>"].comments == {"z": "per entry"}


def test_cli_writes_the_page_and_names_a_missing_defaults_file(tmp_path):
    out = tmp_path / "config.md"
    written = towerrec("config", "reference", "--out", str(out))
    assert written.returncode == 0, written.stderr
    assert out.read_text(encoding="utf-8") == PAGE.read_text(encoding="utf-8")
    missing = towerrec("config", "reference", "--defaults", str(tmp_path / "none.toml"))
    assert missing.returncode == 2 and "none.toml does not exist" in missing.stderr
