"""``attnkit describe NAME --plot FILE``: a mechanism's static pattern drawn from its block index."""

from __future__ import annotations

import pytest
import torch

from attnkit import Attention, Capabilities, masks
from attnkit.cli import main, pattern_picture
from attnkit.reference import softmax_reference


class Banded(Attention):
    """A test pattern: softmax over a causal-or-centred window.

    Args:
        window: keys per query, itself included.
    """

    def __init__(self, *, window: int = 3, num_heads=None, head_dim=None, scale=None, backend="auto"):
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.window = window

    def pattern_mask(self, L, S, *, causal=False):
        return masks.sliding_window(self.window - 1) if causal else masks.sliding_window(self.window // 2,
                                                                                          (self.window - 1) // 2)

    def _attend(self, q, k, v, ctx):
        return softmax_reference(self, q, k, v, mask=self.pattern_mask(q.shape[2], k.shape[2], causal=ctx.causal)
                                 & ctx.mask if ctx.mask is not None else self.pattern_mask(q.shape[2], k.shape[2]))


@pytest.fixture
def reg(no_plugins):
    with no_plugins.registered(Banded, name="banded", family="custom", exact=False,
                               capabilities=Capabilities(causal=True, key_padding_mask=True)):
        yield no_plugins


def run(capsys, argv, reg):
    code = main(argv, registry=reg)
    out, err = capsys.readouterr()
    return code, out, err


def test_the_picture_is_read_from_the_block_index_and_equals_the_mask():
    attn = Banded(window=5)
    for causal in (False, True):
        allowed, state, (bq, bk) = pattern_picture(attn, 40, 40, causal=causal)
        truth = attn.pattern_mask(40, 40, causal=causal).dense(masks.Geometry(1, 1, 40, 40, torch.device("cpu")))
        assert allowed.equal(truth[0, 0]) and (bq, bk) == (5, 5) and state.shape == (8, 8)


def test_describe_plot_writes_a_png(capsys, reg, tmp_path):
    pytest.importorskip("matplotlib")
    out_file = tmp_path / "banded.png"
    code, out, err = run(capsys, ["describe", "banded", "--plot", str(out_file), "--length", "24", "-o", "window=4",
                                  "--causal"], reg)
    assert code == 0, err
    assert out_file.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "banded L=24 causal, 90 allowed pairs" in out  # 4 keys per query, fewer for the first 3


def test_describe_plot_of_a_mechanism_without_a_pattern(capsys, reg, tmp_path):
    pytest.importorskip("matplotlib")
    code, _, err = run(capsys, ["describe", "softmax", "--plot", str(tmp_path / "x.png")], reg)
    assert code == 2 and "'softmax' has no static pattern" in err
    assert Attention.pattern_mask(object(), 4, 4) is None


def test_describe_plot_options_are_checked_and_need_plot(capsys, reg, tmp_path):
    code, _, err = run(capsys, ["describe", "banded", "-o", "window=3"], reg)
    assert code == 2 and "go with --plot FILE" in err
    code, _, err = run(capsys, ["describe", "banded", "--plot", str(tmp_path / "x.png"), "-o", "size=3"], reg)
    assert code == 2 and "takes no option 'size'" in err
    code, _, err = run(capsys, ["describe", "banded", "--plot", str(tmp_path / "x.png"), "--length", "0"], reg)
    assert code == 2 and "--length: expected an int >= 1, got 0" in err


def test_describe_plot_without_matplotlib(capsys, reg, tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_mpl(name, *a, **kw):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("no matplotlib")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    code, _, err = run(capsys, ["describe", "banded", "--plot", str(tmp_path / "x.png")], reg)
    assert code == 2 and "needs matplotlib, which is not installed: pip install matplotlib" in err
