"""Regression tests for the registry, plugin, backend and CLI defects of the hardening issue."""

from __future__ import annotations

import copy
import json
from importlib import metadata

import pytest
import torch

import attnkit
from attnkit import backends
from attnkit import plugins as plugins_mod
from attnkit.cli import main
from attnkit.errors import InvalidInputError, UnknownAttentionError

GROUP = "attnkit.plugins"


def run(capsys, argv, reg=None):
    code = main(argv, registry=reg)
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------ plugin mistakes
def test_plugin_calling_sys_exit_at_import_is_isolated(fake_entry_points):
    reg = fake_entry_points({"exits": "plugin_fixtures.sys_exit", "good": "plugin_fixtures.good"})
    recs = {r.name: r for r in reg.plugin_records()}
    assert recs["exits"].status == "broken" and "SystemExit" in recs["exits"].error
    assert reg.build("doubled") is not None


def test_keyboard_interrupt_at_import_still_propagates(fake_entry_points, monkeypatch):
    reg = fake_entry_points({"good": "plugin_fixtures.good"})

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(metadata.EntryPoint, "load", interrupted)
    with pytest.raises(KeyboardInterrupt):
        reg.specs()


def test_misspelled_hook_is_reported_not_loaded_empty(fake_entry_points):
    reg = fake_entry_points({"typo": "plugin_fixtures.misspelled_hook"})
    rec = {r.name: r for r in reg.plugin_records()}["typo"]
    assert rec.status == "broken"
    assert "attnkit_register_atention" in rec.error and "attnkit_register_attention" in rec.error


def test_one_class_under_two_names_keeps_each_spec(fake_entry_points):
    reg = fake_entry_points({"blocks": "plugin_fixtures.blocks"})
    a, b = reg.build("doubled-a"), reg.build("doubled-b")
    assert a.spec.name == "doubled-a" and b.spec.name == "doubled-b"
    assert a.caps.attn_mask and not b.caps.attn_mask and not b.caps.causal
    assert copy.deepcopy(b).spec.name == "doubled-b"
    assert reg.spec_for_class(type(a)) is None  # ambiguous by class: only build() can tell


def test_allow_list_matches_distributions_and_qualified_entry_points(monkeypatch):
    for var in ("ATTNKIT_PLUGINS", "ATTNKIT_DISABLE_PLUGINS"):
        monkeypatch.delenv(var, raising=False)

    class Dist:
        def __init__(self, name):
            self.metadata = {"Name": name}
            self.version = "1.0"

    eps = []
    for dist, value in (("dist-one", "plugin_fixtures.good"), ("dist-two", "plugin_fixtures.clash")):
        ep = metadata.EntryPoint(name="shared", value=value, group=GROUP)
        object.__setattr__(ep, "dist", Dist(dist))
        eps.append(ep)
    monkeypatch.setattr(plugins_mod.metadata, "entry_points",
                        lambda group=None: eps if group == GROUP else metadata.EntryPoints(()))

    def statuses():
        return {(r.distribution, r.name): r.status for r, _ in plugins_mod.discover()}

    monkeypatch.setenv("ATTNKIT_PLUGINS", "dist-two")
    assert statuses() == {("dist-one", "shared"): "blocked", ("dist-two", "shared"): "pending"}
    monkeypatch.setenv("ATTNKIT_PLUGINS", "dist-one:shared")
    assert statuses() == {("dist-one", "shared"): "pending", ("dist-two", "shared"): "blocked"}
    monkeypatch.setenv("ATTNKIT_PLUGINS", "shared")  # ambiguous: selects neither, with a warning
    with pytest.warns(RuntimeWarning, match="dist-one:shared, dist-two:shared"):
        assert set(statuses().values()) == {"blocked"}
    monkeypatch.delenv("ATTNKIT_PLUGINS")
    monkeypatch.setenv("ATTNKIT_DISABLE_PLUGINS", "dist-two:shared")
    assert statuses() == {("dist-one", "shared"): "pending", ("dist-two", "shared"): "blocked"}


def test_install_suggestions_only_for_known_distributions(no_plugins):
    with pytest.raises(UnknownAttentionError) as info:
        no_plugins.resolve("performer")
    msg = str(info.value)  # the distributions are not on the package index: the install from a checkout
    assert "pip install ./plugins/attnkit-kernelized" in msg and "pip install attnkit-kernelized" not in msg
    with pytest.raises(UnknownAttentionError) as info:
        no_plugins.resolve("bigbird")
    assert "attnkit-sparse, which is not released yet" in str(info.value) and "pip install" not in str(info.value)
    with pytest.raises(UnknownAttentionError) as info:
        no_plugins.resolve("zzzzzz")
    assert "pip install" not in str(info.value) and "attnkit-sparse" not in str(info.value)


# --------------------------------------------------------------------------- blocks
def test_blocks_register_through_their_hook_and_build_by_name(fake_entry_points):
    reg = fake_entry_points({"blocks": "plugin_fixtures.blocks"})
    assert {b.name for b in reg.blocks()} == {"pre-norm", "residual-two"}
    assert reg.resolve_block("r2").distribution == "" and reg.resolve_block("pre-norm").plugin == "attnkit"
    block = reg.build_block("residual-two", dim=8, num_heads=2, attention="softmax", mlp_ratio=0)
    assert block.block_spec.name == "residual-two"
    assert block(torch.randn(2, 5, 8), causal=True).shape == (2, 5, 8)
    with pytest.raises(UnknownAttentionError, match="no block named 'pre-nrom'.*did you mean 'pre-norm'"):
        reg.build_block("pre-nrom", dim=8, num_heads=2)
    with pytest.raises(InvalidInputError, match=r"build_block\('pre-norm'\): option mlp_ratio: expected"):
        reg.build_block("pre-norm", dim=8, num_heads=2, mlp_ratio="big")


def test_in_process_block_registration_always_unregisters():
    spec = attnkit.BlockSpec(name="local-block", factory="attnkit.layers:TransformerBlock", family="custom",
                             summary="x")
    with attnkit.registered_block(spec):
        assert attnkit.build_block("local-block", dim=4, num_heads=1).block_spec.distribution == "local"
    with pytest.raises(UnknownAttentionError):
        attnkit.get_block_spec("local-block")


def test_blocks_shown_by_list_and_describe(capsys, fake_entry_points):
    reg = fake_entry_points({"blocks": "plugin_fixtures.blocks"})
    code, out, _ = run(capsys, ["list"], reg)
    assert code == 0 and "blocks:" in out and "residual-two (r2)" in out and "pre-norm (transformer)" in out
    code, out, _ = run(capsys, ["list", "--json"], reg)
    assert {b["name"] for b in json.loads(out)["blocks"]} == {"pre-norm", "residual-two"}
    code, out, _ = run(capsys, ["describe", "r2"], reg)
    assert code == 0 and "residual-two (block)" in out and "mlp_ratio" in out


# ------------------------------------------------------------------------------ CLI
def test_check_continues_past_a_name_clash(capsys, fake_entry_points):
    reg = fake_entry_points({"good": "plugin_fixtures.good", "clash": "plugin_fixtures.clash"})
    code, out, err = run(capsys, ["check", "--json"], reg)
    reports = json.loads(out)
    assert [r["name"] for r in reports] == ["softmax", "good:doubled", "clash:doubled"]  # each checked
    assert all(r["ok"] for r in reports)
    assert "registered by more than one distribution" in err and "good" in err and "clash" in err
    assert code == 1  # the clash itself fails the run: attnkit.build('doubled') refuses the name


def test_describe_with_a_broken_factory_is_a_clear_error(capsys, fake_entry_points):
    reg = fake_entry_points({"bf": "plugin_fixtures.bad_factory"})
    code, out, err = run(capsys, ["describe", "missing-module"], reg)
    assert code == 2 and "Traceback" not in err
    assert "plugin_fixtures.does_not_exist:Nothing" in err and "'bf'" in err


def test_check_option_values_are_parsed_with_the_schema(capsys, no_plugins):
    from attnkit.cli import parse_options

    spec = no_plugins.resolve("softmax")
    assert parse_options(spec, ["dropout=0", "scale=None", "backend=torch"]) == {
        "dropout": 0.0, "scale": None, "backend": "torch"}
    code, _, err = run(capsys, ["check", "softmax", "-o", "bogus=1"], no_plugins)
    assert code == 2 and "takes no option 'bogus'" in err and "dropout" in err
    code, _, err = run(capsys, ["check", "softmax", "-o", "dropout=1.5"], no_plugins)
    assert code == 2 and "expected a value < 1" in err


def test_bool_option_text_is_a_bool_not_a_truthy_string():
    from attnkit.options import parse_text
    from attnkit.spec import OptionSpec

    opt = OptionSpec("normalize", "bool", True)
    assert parse_text(opt, "False") is False and parse_text(opt, "no") is False and parse_text(opt, "ON") is True
    with pytest.raises(ValueError, match="expected bool"):
        parse_text(opt, "maybe")


def test_check_uses_the_registry_given_to_the_cli(capsys, fake_entry_points):
    reg = fake_entry_points({"good": "plugin_fixtures.good"})
    code, out, _ = run(capsys, ["check", "doubled", "--json"], reg)  # only this registry knows 'doubled'
    report = json.loads(out)[0]
    assert code in (0, 1) and report["name"] == "doubled" and report["passed"] > 5


def test_lab_command_without_the_lab_says_where_it_comes_from(capsys, no_plugins):
    code, _, err = run(capsys, ["bench", "softmax"], no_plugins)
    assert code == 2 and "comes with attnkit-lab" in err and "not installed" in err
    assert "pip install ./packages/attnkit-lab" in err and "pip install attnkit-lab" not in err


# ---------------------------------------------------------------------- backends
def test_misspelled_attnkit_backend_is_an_error(monkeypatch):
    monkeypatch.setenv("ATTNKIT_BACKEND", "numbaa")
    attn = attnkit.build("softmax")
    q = torch.randn(1, 1, 3, 2)
    with pytest.raises(InvalidInputError, match=r"ATTNKIT_BACKEND: expected one of .*'numba'.*got 'numbaa'"):
        attn(q, q, q)


def test_backend_availability_is_cached(monkeypatch):
    backends.clear_cache()
    calls = []
    real = backends.importlib.util.find_spec

    def counting(name, *a, **k):
        calls.append(name)
        return real(name, *a, **k)

    monkeypatch.setattr(backends.importlib.util, "find_spec", counting)
    for _ in range(5):
        backends.why_unavailable("numba", torch.device("cpu"))
    assert calls.count("numba") <= 1
    backends.clear_cache()


def test_forcing_a_backend_the_spec_does_not_offer_is_refused_at_build():
    with pytest.raises(InvalidInputError, match=r"offers backends \['sdpa', 'torch'\].*got 'numba'"):
        attnkit.build("softmax", backend="numba")


def test_available_has_a_short_repr():
    text = repr(attnkit.available())
    assert "AttentionSpec('softmax', family='core', distribution='attnkit')" in text
    assert len(text) < 200 * max(1, len(attnkit.available()))


def test_the_contract_does_not_import_the_registry():
    """attention <-> registry was an import cycle; the registry now hands itself to the contract."""
    import ast
    from pathlib import Path

    src = Path(attnkit.__file__).parent
    for module in ("attention.py", "layers.py", "masks.py", "context.py", "state.py", "aux.py"):
        tree = ast.parse((src / module).read_text(encoding="utf-8"))
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not {"registry", "cli", "testing"} & imported, (module, imported)
