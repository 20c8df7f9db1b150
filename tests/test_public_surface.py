"""The public surface, kept in step (issue 33, item 2): the top package's ``__all__``, its
lazy exports and docs/API.md name the same things; every documented module says what it
exports (``__all__``); the library's own plumbing stays out of the public signatures."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import unickpt
from unickpt import errors

API_MD = Path(__file__).resolve().parent.parent / "docs" / "API.md"
# sections of docs/API.md whose names are imported from their own modules, not the top package
OWN_MODULE_SECTIONS = ("## Integrations", "## PyTorch DCP storage plugin")


def documented() -> tuple[list[str], list[str]]:
    """The ``::: unickpt....`` entries of docs/API.md: (from the top package, from their own module)."""
    top, own, section = [], [], ""
    for line in API_MD.read_text().splitlines():
        if line.startswith("## "):
            section = line
        m = re.fullmatch(r"::: (unickpt(?:\.\w+)+)", line.strip())
        if m:
            (own if section.startswith(OWN_MODULE_SECTIONS) else top).append(m.group(1))
    return top, own


def test_all_is_the_lazy_exports_and_the_errors():
    assert len(unickpt.__all__) == len(set(unickpt.__all__))
    assert set(unickpt.__all__) == set(unickpt._LAZY) | set(errors.__all__)
    for name in unickpt.__all__:
        assert getattr(unickpt, name) is not None, name


def test_api_md_lists_exactly_the_top_level_names():
    top, _ = documented()
    names = set()
    for path in top:
        if path == "unickpt.errors":  # the whole module: every error is exported
            names |= set(errors.__all__)
            continue
        module, _, name = path.rpartition(".")
        obj = getattr(importlib.import_module(module), name)
        assert getattr(unickpt, name) is obj, f"docs/API.md lists {path}, but unickpt.{name} is not it"
        assert name in importlib.import_module(module).__all__, f"{module}.__all__ leaves out {name}"
        names.add(name)
    assert names == set(unickpt.__all__), "docs/API.md and unickpt.__all__ differ"


def test_modules_imported_on_their_own_export_what_the_docs_list():
    _, own = documented()
    assert own
    for path in own:
        module, _, name = path.rpartition(".")
        try:
            mod = importlib.import_module(module)
        except ImportError:  # an integration whose framework is not installed here
            continue
        assert name in mod.__all__, f"{module}.__all__ leaves out {name}"


def test_the_library_s_plumbing_is_not_in_the_public_signatures():
    assert not {"storage", "manifest"} & set(inspect.signature(unickpt.load).parameters)
    assert "target" not in inspect.signature(unickpt.async_save).parameters
    # what users write stays: the documented keywords
    assert {"stats", "per_rank", "cast", "storage_options"} <= set(inspect.signature(unickpt.load).parameters)
    assert {"lazy", "base", "channel", "max_staging_bytes"} <= set(inspect.signature(unickpt.async_save).parameters)


def test_every_public_callable_documents_its_arguments_google_style():
    """Args/Returns/Raises (mkdocstrings' Google style): every parameter of every public
    function and class (exceptions without their own arguments aside) has its line."""
    built_by_the_library = {"AsyncSaveHandle"}  # returned by async_save, never constructed by users
    missing = []
    for name in unickpt.__all__:
        obj = getattr(unickpt, name)
        if name in built_by_the_library or (isinstance(obj, type) and issubclass(obj, Warning)):
            continue
        if isinstance(obj, type) and issubclass(obj, Exception) and "__init__" not in vars(obj):
            continue
        doc = inspect.getdoc(obj) or ""
        params = [p for p in inspect.signature(obj).parameters if p not in ("self", "args", "kwargs")]
        if params and "Args:" not in doc and "Attributes:" not in doc:
            missing.append(f"{name}: no Args (or Attributes) section")
        missing += [f"{name}({p})" for p in params if not re.search(rf"^\s+{p}( \(.*\))?:", doc, re.M)]
    assert not missing, missing
