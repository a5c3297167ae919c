"""The hand-planted bugs of ``scripts/plant_bugs.py`` stay plantable: a plant whose text the code no
longer holds would count as missed only when someone runs the script, so CI checks every one here."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_plants() -> dict:
    spec = importlib.util.spec_from_file_location("plant_bugs", ROOT / "scripts" / "plant_bugs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PLANTS


def test_every_plant_text_occurs_once_and_its_test_files_exist() -> None:
    problems = []
    for name, (path, old, new, target) in load_plants().items():
        count = (ROOT / path).read_text().count(old)
        if count != 1 or old == new:
            problems.append(f"{name}: the planted text occurs {count} times in {path}" if count != 1 else f"{name}: plants no change")
        for test_file in (word.split("::")[0] for word in target.split() if word.startswith("tests/")):
            if not (ROOT / test_file).is_file():
                problems.append(f"{name}: no test file {test_file}")
    assert problems == []
