"""Small registry defects that were listed as known gaps in docs/architecture.md, now fixed."""

from __future__ import annotations

import pytest

import attnkit
from attnkit.errors import UnknownAttentionError
from attnkit.spec import derive_options


def test_distribution_qualifier_is_compared_as_pip_normalises_names(fake_entry_points):
    """``attnkit_good:name``, ``Attnkit.Good:name`` and ``attnkit-good:name`` all name one distribution."""
    reg = fake_entry_points({"good": ("plugin_fixtures.good", "attnkit-good")})
    name = next(s.name for s in reg.specs() if s.distribution == "attnkit-good")
    for qualified in (f"attnkit-good:{name}", f"attnkit_good:{name}", f"Attnkit.Good:{name}", f"attnkit__good:{name}"):
        assert reg.resolve(qualified).distribution == "attnkit-good", qualified
    with pytest.raises(UnknownAttentionError):
        reg.resolve(f"attnkitgood:{name}")  # removing the separator is another name


def test_check_reports_an_unimportable_factory_once(fake_entry_points, capsys):
    from attnkit.cli import main
    from attnkit.testing import run_conformance

    reg = fake_entry_points({"bf": "plugin_fixtures.bad_factory"})
    report = run_conformance("missing-module", registry=reg)
    assert not report.ok
    assert [r.check for r in report.results] == ["import"]
    assert "cannot import the factory plugin_fixtures.does_not_exist:Nothing" in report.results[0].message
    code = main(["check", "missing-module"], registry=reg)
    out = capsys.readouterr().out
    assert code == 1
    assert out.count("cannot import the factory") == 1, out


def test_derived_options_are_cached_and_follow_constraint_changes():
    class Toy(attnkit.Attention):
        def __init__(self, width: int = 4, **kw):
            """Toy.

            Args:
                width: how wide.
            """
            super().__init__(**kw)

    first = derive_options(Toy)
    assert derive_options(Toy) is first  # the cache: no second signature/docstring read
    Toy.option_constraints = {"width": {"minimum": 2}}
    changed = {o.name: o for o in derive_options(Toy)}
    assert changed["width"].minimum == 2  # a changed constraint is seen, not a stale cached schema
    assert changed["width"].help == "how wide."
