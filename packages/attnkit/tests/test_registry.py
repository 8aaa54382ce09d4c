"""Registry and plugin loading: lookup, isolation, env vars, API version, in-process registration."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.errors import (
    AmbiguousNameError,
    InvalidInputError,
    PluginLoadError,
    UnknownAttentionError,
)
from attnkit.softmax import SoftmaxAttention


def test_builtin_softmax_registers_through_the_hook(no_plugins):
    spec = no_plugins.resolve("softmax")
    assert spec.plugin == "attnkit" and spec.distribution == "attnkit"
    assert [r.name for r in no_plugins.plugin_records()] == ["attnkit"]
    assert isinstance(no_plugins.build("softmax"), SoftmaxAttention)


def test_good_plugin_found_with_alias_and_family(fake_entry_points):
    reg = fake_entry_points({"good": "plugin_fixtures.good"})
    assert reg.resolve("doubled").plugin == "good"
    assert reg.resolve("twice").name == "doubled"
    assert reg.resolve("custom/doubled").name == "doubled"
    assert reg.resolve("good:doubled").name == "doubled"
    q = torch.randn(1, 2, 4, 3)
    out = reg.build("doubled")(q, q, q)
    torch.testing.assert_close(out, 2 * torch.nn.functional.scaled_dot_product_attention(q, q, q))


def test_unknown_name_is_a_keyerror_with_suggestions(no_plugins):
    with pytest.raises(KeyError) as info:
        no_plugins.resolve("sofmax")
    err = info.value
    assert isinstance(err, UnknownAttentionError)
    assert err.suggestions == ["softmax"]
    assert "did you mean 'softmax'?" in str(err)


def test_unknown_name_without_close_match_lists_installed(no_plugins):
    with pytest.raises(UnknownAttentionError, match="installed: exact, softmax"):
        no_plugins.resolve("zzzzzz")


def test_collision_is_ambiguous_and_qualified_names_select(fake_entry_points):
    reg = fake_entry_points({"good": "plugin_fixtures.good", "clash": "plugin_fixtures.clash"})
    with pytest.raises(AmbiguousNameError) as info:
        reg.resolve("doubled")
    assert "good" in str(info.value) and "clash" in str(info.value)
    assert reg.resolve("clash:doubled").family == "other"
    assert reg.resolve("custom/doubled").plugin == "good"


def test_broken_import_is_recorded_and_others_keep_working(fake_entry_points):
    reg = fake_entry_points({"bad": "plugin_fixtures.broken_import", "good": "plugin_fixtures.good"})
    recs = {r.name: r for r in reg.plugin_records()}
    assert recs["bad"].status == "broken"
    assert "needs a library that is not installed" in recs["bad"].error
    assert recs["good"].status == "loaded"
    assert reg.resolve("doubled").name == "doubled"
    with pytest.raises(UnknownAttentionError, match="failed to load: bad"):
        reg.resolve("nope-not-here")


def test_raising_hook_drops_its_specs(fake_entry_points):
    reg = fake_entry_points({"hook": "plugin_fixtures.broken_hook"})
    rec = {r.name: r for r in reg.plugin_records()}["hook"]
    assert rec.status == "broken" and "boom in the hook" in rec.error
    with pytest.raises(UnknownAttentionError):
        reg.resolve("half-done")


def test_strict_mode_raises(fake_entry_points, monkeypatch):
    reg = fake_entry_points({"bad": "plugin_fixtures.broken_import"})
    monkeypatch.setenv("ATTNKIT_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError, match="'bad' failed to load: import failed"):
        reg.specs()


def test_future_api_version_is_skipped_with_warning(fake_entry_points):
    reg = fake_entry_points({"future": "plugin_fixtures.future_api"})
    with pytest.warns(RuntimeWarning, match="upgrade attnkit"):
        recs = {r.name: r for r in reg.plugin_records()}
    assert recs["future"].status == "skipped"
    assert "API 2" in recs["future"].error
    with pytest.raises(UnknownAttentionError):
        reg.resolve("from-the-future")


def test_disable_env_blocks_before_import(fake_entry_points, monkeypatch):
    reg = fake_entry_points({"bad": "plugin_fixtures.broken_import", "good": "plugin_fixtures.good"})
    monkeypatch.setenv("ATTNKIT_DISABLE_PLUGINS", "bad, good")
    recs = {r.name: r for r in reg.plugin_records()}
    assert recs["bad"].status == recs["good"].status == "blocked"  # never imported, so not broken
    assert [s.name for s in reg.specs()] == ["softmax"]


def test_allow_list_env(fake_entry_points, monkeypatch):
    reg = fake_entry_points({"good": "plugin_fixtures.good", "clash": "plugin_fixtures.clash"})
    monkeypatch.setenv("ATTNKIT_PLUGINS", "clash")
    assert {s.plugin for s in reg.specs()} == {"attnkit", "clash"}
    reg.reload()
    monkeypatch.setenv("ATTNKIT_PLUGINS", "")
    assert {s.plugin for s in reg.specs()} == {"attnkit"}


def test_reload_rediscovers(fake_entry_points, monkeypatch):
    reg = fake_entry_points({})
    assert [s.name for s in reg.specs()] == ["softmax"]
    fake_entry_points({"good": "plugin_fixtures.good"})  # a later "pip install"
    assert [s.name for s in reg.specs()] == ["softmax"]  # cached
    reg.reload()
    assert "doubled" in [s.name for s in reg.specs()]


def test_factory_that_does_not_import(fake_entry_points):
    reg = fake_entry_points({"bf": "plugin_fixtures.bad_factory"})
    assert reg.resolve("missing-module").name == "missing-module"  # listing never imports
    with pytest.raises(PluginLoadError, match="cannot import the factory plugin_fixtures.does_not_exist:Nothing"):
        reg.build("missing-module")


def test_unknown_build_option_names_the_valid_ones(no_plugins):
    with pytest.raises(InvalidInputError, match=r"'dropuot' \(did you mean 'dropout'\?\)"):
        no_plugins.build("softmax", dropuot=0.1)


def test_available_filters(fake_entry_points):
    reg = fake_entry_points({"good": "plugin_fixtures.good"})
    assert {s.name for s in reg.available(attn_mask=True)} == {"softmax", "doubled"}
    assert [s.name for s in reg.available(streaming="exact")] == ["softmax"]
    assert [s.name for s in reg.available(streaming=False)] == ["doubled"]
    assert [s.name for s in reg.available(backends="sdpa")] == ["softmax"]
    assert [s.name for s in reg.available(family="custom")] == ["doubled"]
    with pytest.raises(InvalidInputError, match="unknown filter"):
        reg.available(casual=True)


def test_in_process_registration_context_manager_always_unregisters():
    class Mine(SoftmaxAttention):
        """Mine."""

    with pytest.raises(RuntimeError):
        with attnkit.registered(Mine, name="mine-test", family="custom") as spec:
            assert attnkit.get_spec("mine-test") is spec
            assert attnkit.build("mine-test").spec.distribution == "local"
            raise RuntimeError("leave the block")
    with pytest.raises(UnknownAttentionError):
        attnkit.get_spec("mine-test")


def test_register_twice_and_bad_arguments():
    class Mine(SoftmaxAttention):
        """Mine."""

    with attnkit.registered(Mine, name="mine-twice"):
        with pytest.raises(InvalidInputError, match="already registered"):
            attnkit.register(Mine, name="mine-twice")
    with pytest.raises(InvalidInputError, match="expected an AttentionSpec or an attnkit.Attention"):
        attnkit.register(object())
    with pytest.raises(InvalidInputError, match="needs name="):
        attnkit.register(Mine)
    with pytest.raises(InvalidInputError, match="lower-case"):
        attnkit.register(Mine, name="Bad Name")
    with pytest.raises(InvalidInputError, match="unknown spec field"):
        attnkit.register(Mine, name="ok-name", colour="red")
    with pytest.raises(InvalidInputError, match="not registered"):
        attnkit.unregister("never-registered")


def test_plugin_context_manager_loads_hooks_and_cleans_up(no_plugins):
    from plugin_fixtures import good

    with no_plugins.plugin(good, name="good-inline") as rec:
        assert rec.status == "loaded"
        assert no_plugins.resolve("doubled").plugin == "good-inline"
    with pytest.raises(UnknownAttentionError):
        no_plugins.resolve("doubled")


def test_spec_validation_errors():
    with pytest.raises(InvalidInputError, match="factory must be 'module.path:ClassName'"):
        attnkit.AttentionSpec(name="x", factory="nocolon", family="custom", summary="")
    with pytest.raises(InvalidInputError, match="streaming must be one of"):
        attnkit.Capabilities(streaming="sometimes")
    with pytest.raises(InvalidInputError, match="must include 'torch'"):
        attnkit.Capabilities(backends=("numba",))
    with pytest.raises(InvalidInputError, match="floating dtypes"):
        attnkit.Capabilities(dtypes=("int8",))
    with pytest.raises(InvalidInputError, match=r"func_transforms must be a tuple of \(.*\), got 'grad'"):
        attnkit.Capabilities(func_transforms="grad")
    with pytest.raises(InvalidInputError, match="func_transforms must be a tuple of .* got \\('hessian',\\)"):
        attnkit.Capabilities(func_transforms=("hessian",))
    assert attnkit.Capabilities(func_transforms=["vmap"]).func_transforms == ("vmap",)
    with pytest.raises(InvalidInputError, match="error_bound"):
        attnkit.AttentionSpec(name="x", factory="a:b", family="custom", summary="", error_bound=-1.0)


def test_options_schema_derived_from_signature_and_docstring():
    opts = {o.name: o for o in attnkit.get_spec("softmax").resolved_options()}
    assert opts["dropout"].default == 0.0 and opts["dropout"].type == "float"
    assert "dropout probability" in opts["dropout"].help
    assert opts["backend"].default == "auto"


def test_build_with_hints_passes_only_what_the_factory_takes(fake_entry_points):
    from plugin_fixtures.good import Doubled

    class NoHeads(SoftmaxAttention):
        """Takes no num_heads/head_dim."""

        def __init__(self, *, scale: float | None = None):
            super().__init__(scale=scale)

    reg = fake_entry_points({})
    with reg.registered(Doubled, name="takes-heads"), reg.registered(NoHeads, name="no-heads"):
        a = reg.build_with_hints("takes-heads", {"num_heads": 4, "head_dim": 8})
        assert (a.num_heads, a.head_dim) == (4, 8)
        b = reg.build_with_hints("takes-heads", {"num_heads": 4, "head_dim": 8}, num_heads=2)
        assert (b.num_heads, b.head_dim) == (2, 8)  # an explicit option wins over the hint
        c = reg.build_with_hints("no-heads", {"num_heads": 4, "head_dim": 8}, scale=0.5)
        assert c.num_heads is None and c.scale == 0.5
        with pytest.raises(InvalidInputError, match="unknown option"):
            reg.build("no-heads", num_heads=4)  # what the hints avoid
