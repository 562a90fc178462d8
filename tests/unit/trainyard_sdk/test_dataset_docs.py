"""docs/sdk.md documents every attribute of ``run.dataset()`` (a DatasetManifest), and nothing it lacks."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from trainyard.data import DatasetManifest

SDK_DOC = Path(__file__).resolve().parents[3] / "docs" / "sdk.md"


def fields(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every field of ``model``, nested models' too (``tokenizer.vocab_size``; ``shards[i].file``)."""
    out: set[str] = set()
    for name, info in model.model_fields.items():
        annotation = info.annotation
        args = getattr(annotation, "__args__", ())
        nested = next((a for a in (annotation, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if nested is None:
            out.add(prefix + name)
        elif name == "import_info":  # documented in one row: its fields named in the text
            out.add(prefix + name)
            out |= {f"{prefix}{name}.{sub}" for sub in nested.model_fields}
        else:
            item = f"{name}[i]" if "list" in str(annotation) else name
            out |= fields(nested, f"{prefix}{item}.")
    return out


def documented() -> set[str]:
    section = SDK_DOC.read_text().split("### `run.dataset()`", 1)[1].split("\n### ", 1)[0]
    names: set[str] = set()
    for row in re.findall(r"^\| (`.+?) \| (.*) \|$", section, flags=re.M):
        cell, text = row
        first, *more = re.findall(r"`([^`]+)`", cell)
        names.add(first)
        base = first.rsplit(".", 1)[0] if "." in first else ""
        names |= {(f"{base}{m}" if m.startswith(".") else m) for m in more}
        if first == "import_info":
            names |= {f"import_info{m}" for m in re.findall(r"`(\.[a-z_]+)`", text)}
    return names


def test_every_attribute_of_the_dataset_manifest_is_documented() -> None:
    assert documented() == fields(DatasetManifest)
