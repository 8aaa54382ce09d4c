"""The lab plugs into the attnkit CLI through the entry point and the command hook."""

from __future__ import annotations

import importlib.metadata as md

import pytest

from attnkit_lab import cli as lab_cli


def test_entry_point_and_commands(cli):
    eps = [ep for ep in md.entry_points(group="attnkit.plugins") if ep.name == "lab"]
    assert eps and eps[0].value == "attnkit_lab.plugin"
    with pytest.raises(SystemExit):
        cli("--help")


def test_help_lists_commands(capsys):
    from attnkit.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("bench", "error", "train", "demo"):
        assert name in out


def test_parse_lengths():
    assert lab_cli.parse_int_list("256..2K", option="--lengths") == [256, 512, 1024, 2048]
    assert lab_cli.parse_int_list("1k, 64,64", option="--lengths") == [64, 1024]


def test_readme_demo_section_names_the_command_its_table_comes_from():
    """The README's "What the demo shows" table is not the demo's output: it is labelled with the
    command of docs/lab/results.md it comes from, and its figures are that run's."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    readme, results = root / "README.md", root / "docs" / "lab" / "results.md"
    if not (readme.exists() and results.exists()):
        pytest.skip("not in a checkout")
    section = readme.read_text().split("### What the demo shows", 1)[1].split("\n## ", 1)[0]
    assert "not** the demo's output" in section
    words = " ".join(section.replace("\\\n", " ").split())
    for cfg in ("softmax linear", "linear@feature_map=dpfp,dpfp_nu=1", "linear@feature_map=dpfp,dpfp_nu=2",
                "performer@num_features=16", "performer@num_features=64", "performer@num_features=256"):
        assert cfg in words and cfg in " ".join(results.read_text().replace("\\\n", " ").split())
    assert "attnkit train mqar --preset quick --attention softmax linear" in words
    for figure in ("0.102", "0.971", "1.000"):
        assert figure in section and figure in results.read_text()


def test_choice_syntax():
    from attnkit_lab.names import parse_choice

    c = parse_choice("performer@num_features=64,orthogonal=false,feature_map=trig")
    assert c.name == "performer" and c.options == {"num_features": 64, "orthogonal": False, "feature_map": "trig"}
    from attnkit.errors import UsageError

    with pytest.raises(UsageError, match="key=value"):
        parse_choice("performer@64")


def test_demo_tiny(cli, tmp_path, tiny_demo):
    """The demo end to end, with the quick presets shrunk to toy sizes."""
    from conftest import NoisySoftmax

    import attnkit

    out = tmp_path / "demo"
    with attnkit.registered(NoisySoftmax, name="toy-noisy", family="test", summary="noisy"):
        code, stdout, err = cli("demo", "--attention", "softmax", "toy-noisy", "--out", str(out), "-q")
    assert code == 0, err
    for f in ("README.md", "bench/bench.png", "bench/table.md", "train-mqar/learning_curves.png",
              "train-mqar/table.md", "error/error.png", "error/table.md"):
        assert (out / f).exists(), f
    readme = (out / "README.md").read_text()
    assert "attnkit bench softmax toy-noisy" in readme and "--from-run train-mqar" in readme
    assert str(out) in stdout


def test_demo_runs_clean(cli, tmp_path, tiny_demo, toy_mechanisms):
    """The demo's own configuration produces no warning: an approximation without a budget option
    (like linear attention's elu map, in the default demo) is measured at its default configuration
    and the error table says so; nothing on stderr but the section headers."""
    import warnings

    out = tmp_path / "demo"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, stdout, err = cli("demo", "--attention", "softmax", "toy-fixed", "toy-noisy", "--out", str(out), "-q")
    assert code == 0, err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("USDT:")]   # kineto's own banner
    assert all(ln.startswith("===") or ln.startswith("demo finished") for ln in lines), lines
    assert not [w for w in caught if "attnkit" in (w.filename or "")], [str(w.message) for w in caught]
    table = (out / "error" / "table.md").read_text()
    assert "`toy-fixed`: softmax + 1 %; no budget option: measured at its default configuration only" in table
    assert "budget option: `num_features`" in table


def test_demo_default_choices_prefer_the_documented_mechanisms(monkeypatch):
    from attnkit_lab import demo, names

    installed = ["rfa", "fast-weight", "performer", "softmax", "linear"]
    monkeypatch.setattr(names, "default_choices",
                        lambda exact=None: [names.AttentionChoice(n, n) for n in installed])
    assert [c.label for c in demo.demo_choices()] == ["softmax", "linear", "performer"]
    installed[:] = ["rfa", "fast-weight"]
    assert [c.label for c in demo.demo_choices()] == ["rfa", "fast-weight"]


def _lab_imports():
    """{module: the lab modules it imports, at module level or inside functions}."""
    import ast
    from pathlib import Path

    import attnkit_lab

    root = Path(attnkit_lab.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mod = ".".join(parts)
        package = parts if is_pkg else parts[:-1]
        deps = graph.setdefault(mod, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if node.module is None:
                    deps.update(f"{target}.{a.name}" for a in node.names)
                else:
                    deps.add(target)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
    return {m: {d for d in ds if d in graph and d != m} for m, ds in graph.items()}


def test_no_import_cycles_in_the_lab():
    graph = _lab_imports()
    assert "attnkit_lab.cli" in graph and "attnkit_lab.demo" in graph["attnkit_lab.cli"]
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles
