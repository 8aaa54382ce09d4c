"""Regression tests for what the first hardening pass left open (each fails on the code before the fix).

Hook validation as pluggy's ``check_pending`` does it (``specname=`` and ``optionalhook`` are not
misspellings), inline plugins' blocks cleaned up, ``sys.exit()`` in a command hook, options annotated
with typing objects, strict choices, constraint mistakes, one message format, a clash failing
``attnkit check``, install hints that never name a package the index does not have, allow/block lists
with pip's name normalisation and warnings for entries matching nothing, third-party backend names in
``ATTNKIT_BACKEND``, ``BlockSpec.causal``.
"""

from __future__ import annotations

import math
import pickle
import types
import warnings

import pytest
import torch

import attnkit
from attnkit import backends
from attnkit.cli import main, parse_options
from attnkit.errors import InvalidInputError, PluginLoadError, UnknownAttentionError, UsageError
from attnkit.softmax import SoftmaxAttention


def run(capsys, argv, reg=None):
    code = main(argv, registry=reg)
    out, err = capsys.readouterr()
    return code, out, err


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


# ------------------------------------------------------------------ hooks
def test_specname_and_optionalhook_implementations_are_not_misspellings(no_plugins):
    """Only what pluggy's check_pending() rejects is an unknown hook: an implementation named through
    ``specname=`` registers, one marked ``optionalhook=True`` (for a newer attnkit) is allowed."""

    @attnkit.hookimpl(specname="attnkit_register_attention")
    def register_mine(register):
        register(attnkit.AttentionSpec(name="via-specname", family="custom", summary="x",
                                       factory="attnkit.softmax:SoftmaxAttention"))

    @attnkit.hookimpl(optionalhook=True)
    def attnkit_register_something_newer(register):
        raise AssertionError("never called: no such hook here")

    mod = _module("specname_plugin", register_mine=register_mine,
                  attnkit_register_something_newer=attnkit_register_something_newer)
    with no_plugins.plugin(mod, name="specname") as rec:
        assert rec.status == "loaded", rec.error
        assert no_plugins.resolve("via-specname").plugin == "specname"


def test_misspelled_hook_names_the_close_valid_one(fake_entry_points):
    reg = fake_entry_points({"typo": "plugin_fixtures.misspelled_hook"})
    rec = {r.name: r for r in reg.plugin_records()}["typo"]
    assert rec.status == "broken"
    assert "'attnkit_register_atention' (did you mean 'attnkit_register_attention'?)" in rec.error
    assert "attnkit_register_block" in rec.error and "optionalhook=True" in rec.error


def test_an_inline_plugins_blocks_leave_with_it(no_plugins):
    @attnkit.hookimpl
    def attnkit_register_block(register):
        register(attnkit.BlockSpec(name="inline-block", factory="attnkit.layers:TransformerBlock",
                                   family="custom", summary="x"))

    with no_plugins.plugin(_module("inline_blocks", attnkit_register_block=attnkit_register_block)):
        assert no_plugins.resolve_block("inline-block").plugin == "local-plugin"
    assert [b.name for b in no_plugins.blocks()] == ["pre-norm"]
    with pytest.raises(UnknownAttentionError, match="no block named 'inline-block'"):
        no_plugins.resolve_block("inline-block")


def test_sys_exit_in_a_command_hook_is_isolated(capsys, no_plugins):
    @attnkit.hookimpl
    def attnkit_register_commands(cli):
        raise SystemExit(3)

    with no_plugins.plugin(_module("exits_in_commands", attnkit_register_commands=attnkit_register_commands),
                           name="exiter"):
        code, out, _ = run(capsys, ["list"], no_plugins)
        assert code == 0
        assert "exiter" in out and "attnkit_register_commands raised SystemExit" in out


# ------------------------------------------------------------------ options
def test_typing_annotations_keep_their_arguments(fake_entry_points):
    """``Optional[int]`` and ``Literal[...]`` objects (no postponed annotations) were read as 'Optional'
    and 'Literal', so nothing was checked."""
    reg = fake_entry_points({"typed": "plugin_fixtures.typed_options"})
    types_ = {o.name: o.type for o in reg.resolve("typed").resolved_options()}
    assert types_["mode"] == "Literal['fast', 'exact']" and types_["seed"] == "Optional[int]"
    with pytest.raises(InvalidInputError,
                       match=r"^build\('typed'\): option mode: expected one of 'fast', 'exact', got 'slow' \(str\)$"):
        reg.build("typed", mode="slow")
    with pytest.raises(InvalidInputError, match=r"option seed: expected int or None, got 1\.5 \(float\)$"):
        reg.build("typed", seed=1.5)
    with pytest.raises(InvalidInputError, match=r"option scale: expected a finite number, got nan \(float\)$"):
        reg.build("typed", scale=math.nan)
    built = reg.build("typed", mode="exact", seed=None, scale=None)
    assert (built.mode, built.seed, built.scale) == ("exact", None, None)


@pytest.mark.parametrize("options, message", [
    ({"width": 0}, r"option width: expected a value >= 1, got 0 \(int\)$"),
    ({"ratio": 1.0}, r"option ratio: expected a value < 1, got 1\.0 \(float\)$"),
    ({"ratio": -0.5}, r"option ratio: expected a value >= 0, got -0\.5 \(float\)$"),
    ({"level": True}, r"option level: expected one of \[0, 1\], got True \(bool\)$"),  # True == 1, not 1
    ({"level": 2}, r"option level: expected one of \[0, 1\], got 2 \(int\)$"),
    ({"bit": True}, r"option bit: expected one of 0, 1, got True \(bool\)$"),
    ({"flag": "no"}, r"option flag: expected bool, got 'no' \(str\)$"),
])
def test_declared_ranges_and_choices_name_the_type_given(fake_entry_points, options, message):
    reg = fake_entry_points({"typed": "plugin_fixtures.typed_options"})
    with pytest.raises(InvalidInputError, match=message):
        reg.build("typed", **options)


def test_declared_values_at_the_edges_are_taken(fake_entry_points):
    reg = fake_entry_points({"typed": "plugin_fixtures.typed_options"})
    built = reg.build("typed", width=1, ratio=0.0, level=1, bit=1, flag=False)
    assert (built.width, built.ratio, built.level, built.bit, built.flag) == (1, 0.0, 1, 1, False)


def test_option_constraints_mistakes_are_named(no_plugins):
    class Misspelt(SoftmaxAttention):
        """A constraint key with a typo."""

        option_constraints = {"dropout": {"minimun": 0}}

    class Stray(SoftmaxAttention):
        """A constraint for an option the constructor does not take."""

        option_constraints = {"dropuot": {"minimum": 0}}

    with no_plugins.registered(Misspelt, name="misspelt"), no_plugins.registered(Stray, name="stray"):
        with pytest.raises(PluginLoadError, match=r"option_constraints\['dropout'\]: unknown key\(s\) \['minimun'\]; "
                                                  r"valid keys: \['choices', 'minimum'"):
            no_plugins.build("misspelt")
        with pytest.raises(PluginLoadError, match=r"option_constraints names \['dropuot'\], which the constructor "
                                                  r"does not take"):
            no_plugins.build("stray")


def test_cli_option_values_follow_typing_annotations(capsys, fake_entry_points):
    reg = fake_entry_points({"typed": "plugin_fixtures.typed_options"})
    spec = reg.resolve("typed")
    assert parse_options(spec, ["mode=exact", "seed=none", "flag=No", "ratio=0.25", "width=3", "bit=1"]) == {
        "mode": "exact", "seed": None, "flag": False, "ratio": 0.25, "width": 3, "bit": 1}
    for bad, why in (["seed=1.5"], "expected int or None"), (["width=0"], "expected a value >= 1"), \
                     (["flag=maybe"], "expected bool"), (["mode=slow"], "expected one of 'fast', 'exact'"):
        with pytest.raises(UsageError, match=why):
            parse_options(spec, bad)
    code, out, err = run(capsys, ["check", "typed", "-o", "ratio=nan"], reg)
    assert code == 2 and out == "" and "--option ratio" in err and "finite" in err


# ------------------------------------------------------------------ check
def test_a_clash_within_one_distribution_is_qualified_by_plugin():
    """Two entry points of one distribution registering one name: ``dist:name`` would still be ambiguous."""
    from attnkit.cli import _check_targets

    def spec(plugin, dist):
        return attnkit.AttentionSpec(name="twin", family="custom", summary="x", factory="a:b",
                                     plugin=plugin, distribution=dist)

    targets, clashes = _check_targets([spec("p1", "dist"), spec("p2", "dist"), spec("p3", "other")])
    assert [t for t, _ in targets] == ["p1:twin", "p2:twin", "other:twin"]
    assert len(clashes) == 1 and "dist (plugin p1), dist (plugin p2), other (plugin p3)" in clashes[0]


def test_each_name_of_a_class_registered_twice_is_checked_with_its_own_spec(fake_entry_points):
    from attnkit.testing import run_conformance

    reg = fake_entry_points({"blocks": "plugin_fixtures.blocks"})
    report = run_conformance("doubled-b", registry=reg, checks=["refusals", "attn_mask", "causality"])
    assert report.ok, report.format()
    assert report["causality"].status == "skipped"  # doubled-b declares causal=False; doubled-a would not skip
    b = reg.build("doubled-b")
    assert pickle.loads(pickle.dumps(b)).spec.name == "doubled-b"


# ------------------------------------------------------------------ install hints
def test_unknown_name_of_an_installed_but_blocked_distribution_says_why(fake_entry_points, monkeypatch):
    reg = fake_entry_points({"kernelized": ("plugin_fixtures.good", "attnkit-kernelized")})
    monkeypatch.setenv("ATTNKIT_DISABLE_PLUGINS", "attnkit-kernelized")
    with pytest.raises(UnknownAttentionError) as info:
        reg.resolve("performer")
    msg = str(info.value)
    assert "attnkit-kernelized provides it but is installed and not loaded (blocked: blocked by " \
           "ATTNKIT_DISABLE_PLUGINS)" in msg
    assert "pip install" not in msg


def test_lab_command_when_the_lab_is_installed_but_blocked(capsys, fake_entry_points, monkeypatch):
    reg = fake_entry_points({"lab": ("plugin_fixtures.good", "attnkit-lab")})
    monkeypatch.setenv("ATTNKIT_DISABLE_PLUGINS", "attnkit-lab")
    code, _, err = run(capsys, ["train", "mqar"], reg)
    assert code == 2 and "comes with attnkit-lab, which is installed but not loaded (blocked" in err
    assert "pip install" not in err


# ------------------------------------------------------------------ allow / block lists
def test_lists_compare_distribution_names_as_pip_does(fake_entry_points, monkeypatch):
    reg = fake_entry_points({"good": ("plugin_fixtures.good", "Attnkit_Good"), "clash": "plugin_fixtures.clash"})
    monkeypatch.setenv("ATTNKIT_PLUGINS", "attnkit-good")
    assert {r.name: r.status for r in reg.plugin_records()} == {"attnkit": "loaded", "good": "loaded",
                                                               "clash": "blocked"}
    reg.reload()
    monkeypatch.setenv("ATTNKIT_PLUGINS", "ATTNKIT.GOOD:good")
    assert {r.name: r.status for r in reg.plugin_records()}["good"] == "loaded"


@pytest.mark.parametrize("var", ["ATTNKIT_PLUGINS", "ATTNKIT_DISABLE_PLUGINS"])
def test_a_list_entry_matching_nothing_is_warned_about(fake_entry_points, monkeypatch, var):
    reg = fake_entry_points({"good": ("plugin_fixtures.good", "attnkit-good")})
    monkeypatch.setenv(var, "attnkit-goood")
    with pytest.warns(RuntimeWarning, match=rf"{var}: 'attnkit-goood' matches no installed plugin "
                                            r"\(installed: \['attnkit-good:good'\]\)"):
        records = {r.name: r.status for r in reg.plugin_records()}
    assert records["good"] == ("blocked" if var == "ATTNKIT_PLUGINS" else "loaded")


def test_matching_entries_warn_about_nothing(fake_entry_points, monkeypatch):
    reg = fake_entry_points({"good": ("plugin_fixtures.good", "attnkit-good")})
    monkeypatch.setenv("ATTNKIT_PLUGINS", "good, attnkit-good, attnkit-good:good")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert {r.name: r.status for r in reg.plugin_records()}["good"] == "loaded"


# ------------------------------------------------------------------ backends
def test_attnkit_backend_may_name_a_backend_a_registered_spec_offers(no_plugins, monkeypatch):
    """A third party's backend name was refused for everyone, even the implementation offering it."""
    monkeypatch.setattr(backends, "_DECLARED", set())

    class OwnKernel(SoftmaxAttention):
        """Softmax with a third party's backend name."""

    caps = attnkit.Capabilities(attn_mask=True, backends=("mykernel", "torch"))
    with no_plugins.registered(OwnKernel, name="own-kernel", capabilities=caps):
        own, softmax = no_plugins.build("own-kernel"), no_plugins.build("softmax")
        q = torch.randn(1, 1, 3, 2)
        monkeypatch.setenv("ATTNKIT_BACKEND", "mykernel")
        assert own.resolve_backend(q) == "mykernel"      # forced where offered
        assert softmax.resolve_backend(q) == "sdpa"      # the others stay on auto
        monkeypatch.setenv("ATTNKIT_BACKEND", "mykernal")
        with pytest.raises(InvalidInputError, match=r"ATTNKIT_BACKEND: expected one of \['auto', 'torch', .*"
                                                    r"'mykernel'\], got 'mykernal'; fix or unset"):
            softmax.resolve_backend(q)


def test_check_offered_names_the_offered_backends():
    assert backends.check_offered("x", ("numba", "torch"), "auto") == "auto"
    assert backends.check_offered("x", ("numba", "torch"), "numba") == "numba"
    with pytest.raises(InvalidInputError, match=r"'x' offers backends \['numba', 'torch'\] \(or 'auto'\), "
                                                r"got 'triton'; pass one of them"):
        backends.check_offered("x", ("numba", "torch"), "triton")
    with pytest.raises(InvalidInputError, match=r"expected 'auto' or one of .* got 3 \(int\)"):
        backends.check_offered("x", ("torch",), 3)


def test_build_checks_backend_when_the_factory_only_takes_keywords(no_plugins):
    class Keywords(SoftmaxAttention):
        """Options behind ``**kwargs``: the schema cannot type-check ``backend``; the offered check still runs."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)

    with no_plugins.registered(Keywords, name="keywords"):
        with pytest.raises(InvalidInputError, match=r"^build\('keywords'\): option backend: expected 'auto' or one "
                                                    r"of the backends 'keywords' offers \['torch'\], got 3 \(int\)"):
            no_plugins.build("keywords", backend=3)
        with pytest.raises(InvalidInputError, match=r"option backend: 'keywords' offers backends \['torch'\]"):
            no_plugins.build("keywords", backend="numba")
        assert no_plugins.build("keywords", backend="torch").backend == "torch"


# ------------------------------------------------------------------ blocks
def test_block_spec_declares_whether_it_takes_causal():
    kw = dict(name="acausal", factory="attnkit.layers:TransformerBlock", family="custom", summary="x")
    assert attnkit.BlockSpec(**kw).causal is True
    spec = attnkit.BlockSpec(**kw, causal=False)
    assert spec.causal is False and spec.as_dict()["causal"] is False
    with pytest.raises(InvalidInputError, match="BlockSpec.causal must be a bool, got 'yes'"):
        attnkit.BlockSpec(**kw, causal="yes")
