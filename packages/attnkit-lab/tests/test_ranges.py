"""Every numeric option is range-checked: a usage error naming the option, the range and the value (exit 2)."""

from __future__ import annotations

import pytest

from attnkit.errors import UsageError
from attnkit_lab.options import check_float, check_int, parse_int, parse_int_list

# (command and arguments, option named, the expected range as printed, the value as printed)
CASES = [
    # bench
    (["bench", "softmax", "--lengths", "100M"], "--lengths", "16,777,216 (2**24)", "'100M' (= 104,857,600)"),
    (["bench", "softmax", "--lengths", "0,16"], "--lengths", "in [1, 16,777,216 (2**24)]", "'0'"),
    (["bench", "softmax", "--lengths", "1.0001K"], "--lengths", "an integer", "'1.0001K'"),
    (["bench", "softmax", "--batch", "0"], "--batch", "in [1, 65,536 (2**16)]", "0"),
    (["bench", "softmax", "--heads", "100000"], "--heads", "in [1, 65,536 (2**16)]", "100000"),
    (["bench", "softmax", "--head-dim", "-1"], "--head-dim", "in [1, 65,536 (2**16)]", "-1"),
    (["bench", "softmax", "--repeats", "0"], "--repeats", ">= 1", "0"),
    (["bench", "softmax", "--warmup", "0"], "--warmup", ">= 1", "0"),
    (["bench", "softmax", "--time-limit", "0"], "--time-limit", "> 0", "0.0"),
    (["bench", "softmax", "--time-limit", "nan"], "--time-limit", "a finite number > 0", "nan"),
    (["bench", "softmax", "--seed", "-1"], "--seed", "in [0, 4,294,967,295 (2**32 - 1)]", "-1"),
    (["bench", "softmax", "--seed", str(2 ** 32)], "--seed", "in [0, 4,294,967,295 (2**32 - 1)]", str(2 ** 32)),
    (["bench", "softmax", "--threads", "0"], "--threads", "in [1, 1024]", "0"),
    # error
    (["error", "softmax", "--budgets", "0"], "--budgets", "in [1, 16,777,216 (2**24)]", "'0'"),
    (["error", "softmax", "--budget-length", "64M"], "--budget-length", "16,777,216 (2**24)", "'64M'"),
    (["error", "softmax", "--weights-max-length", "32M"], "--weights-max-length", "in [0, 16,777,216 (2**24)]",
     "'32M'"),
    (["error", "softmax", "--temperatures", "2,0"], "--temperatures", "finite numbers > 0", "0"),
    (["error", "softmax", "--temperatures", "inf"], "--temperatures", "finite numbers > 0", "inf"),
    (["error", "softmax", "--trials", "0"], "--trials", ">= 1", "0"),
    (["error", "softmax", "--heads", "0"], "--heads", "in [1, 65,536 (2**16)]", "0"),
    # train: model and optimisation
    (["train", "mqar", "--dropout", "1.5"], "--dropout", "in [0, 1)", "1.5"),
    (["train", "mqar", "--dropout", "1"], "--dropout", "in [0, 1)", "1.0"),
    (["train", "mqar", "--dropout", "-0.1"], "--dropout", "in [0, 1)", "-0.1"),
    (["train", "mqar", "--lr", "0"], "--lr", "> 0", "0.0"),
    (["train", "mqar", "--lr", "inf"], "--lr", "a finite number > 0", "inf"),
    (["train", "mqar", "--weight-decay", "-1"], "--weight-decay", ">= 0", "-1.0"),
    (["train", "mqar", "--steps", "0"], "--steps", ">= 1", "0"),
    (["train", "mqar", "--batch-size", "0"], "--batch-size", "in [1, 65,536 (2**16)]", "0"),
    (["train", "mqar", "--warmup", "-1"], "--warmup", ">= 0", "-1"),
    (["train", "mqar", "--eval-every", "0"], "--eval-every", ">= 1", "0"),
    (["train", "mqar", "--eval-batches", "-2"], "--eval-batches", ">= 1", "-2"),
    (["train", "mqar", "--depth", "0"], "--depth", "in [1, 1024]", "0"),
    (["train", "mqar", "--mlp-ratio", "0"], "--mlp-ratio", "in (0, 1024]", "0.0"),
    (["train", "mqar", "--seed", "-5"], "--seed", "in [0, 4,294,967,295 (2**32 - 1)]", "-5"),
    # train: task options
    (["train", "mqar", "--seq-len", "0"], "--seq-len", "in [1, 16,777,216 (2**24)]", "0"),
    (["train", "copy", "--vocab", "-3"], "--vocab", "in [1, 16,777,216 (2**24)]", "-3"),
    (["train", "mqar", "--num-kv-pairs", "0"], "--num-kv-pairs", "in [1, 16,777,216 (2**24)]", "0"),
    (["train", "mqar", "--power-a", "0"], "--power-a", "in (0, 1]", "0.0"),
    (["train", "listops", "--max-depth", "1000"], "--max-depth", "in [1, 100]", "1000"),
    (["train", "listops", "--min-length", "-1"], "--min-length", "in [0, 16,777,216 (2**24)]", "-1"),
    (["train", "lm", "--val-fraction", "1"], "--val-fraction", "in (0, 1)", "1.0"),
    (["train", "lm", "--corpus-chars", "0"], "--corpus-chars", ">= 1", "0"),
    # demo
    (["demo", "--bench-max-length", "100M"], "--bench-max-length", "16,777,216 (2**24)", "'100M'"),
    (["demo", "--seed", "-1"], "--seed", "in [0, 4,294,967,295 (2**32 - 1)]", "-1"),
    (["demo", "--threads", "5000"], "--threads", "in [1, 1024]", "5000"),
]


@pytest.mark.parametrize("argv, option, expected, given", CASES, ids=[" ".join(c[0][:1] + c[0][2:]) for c in CASES])
def test_out_of_range_is_a_usage_error(cli, tmp_path, argv, option, expected, given):
    out = tmp_path / "out"
    extra = ["--attention", "softmax"] if argv[0] == "train" else []
    code, _, err = cli(*argv, *extra, "--out", str(out), "-q")
    assert code == 2, err
    assert f"{option}: expected" in err and expected in err and f"got {given}" in err, err
    assert "Traceback" not in err
    assert not list(tmp_path.iterdir())                      # checked before any directory is created


def test_check_helpers():
    assert check_int(5, "--n", lo=1, hi=5) == 5
    assert check_float(0.0, "--p", lo=0, hi=1, hi_open=True) == 0.0
    for bad in (True, 2.0, "3", None):
        with pytest.raises(UsageError, match="--n: expected an integer"):
            check_int(bad, "--n")
    with pytest.raises(UsageError, match=r"--p: expected a finite number in \[0, 1\), got 1"):
        check_float(1, "--p", lo=0, hi=1, hi_open=True)
    assert parse_int("16M", option="--x") == 2 ** 24
    assert parse_int("0", option="--x", lo=0) == 0
    assert parse_int_list("256..2K", option="--lengths") == [256, 512, 1024, 2048]
    assert parse_int_list("1k, 64,64", option="--lengths") == [64, 1024]
    with pytest.raises(UsageError, match="increasing range"):
        parse_int_list("8K..256", option="--lengths")


def test_valid_edges_are_accepted(cli, tmp_path):
    """The bounds themselves pass: dropout 0, warmup 0, seed 2**32 - 1."""
    out = tmp_path / "t"
    code, _, err = cli("train", "mqar", "--attention", "softmax", "--dropout", "0", "--warmup", "0",
                       "--seed", str(2 ** 32 - 1), "--steps", "1", "--eval-every", "1", "--eval-batches", "1",
                       "--batch-size", "2", "--dim", "8", "--heads", "1", "--depth", "1", "--seq-len", "16",
                       "--vocab", "16", "--num-kv-pairs", "2", "--out", str(out), "-q")
    assert code == 0, err


# NAME@option=value: the value is checked against the spec's option schema (type, range, choices)
# before any work starts, in every command (train and error used to record it as a failed run, exit 0)
MECHANISM_CASES = [
    (["train", "mqar", "--attention", "softmax@dropout=1.5"], "--attention 'softmax@dropout=1.5'",
     "option dropout: expected a value < 1", "got 1.5"),
    (["train", "mqar", "--attention", "softmax", "softmax@scale=-1"], "--attention 'softmax@scale=-1'",
     "option scale: expected a value > 0", "got -1"),
    (["error", "softmax@dropout=-0.5"], "NAME 'softmax@dropout=-0.5'", "option dropout: expected a value >= 0",
     "got -0.5"),
    (["bench", "softmax@backend=7"], "NAME 'softmax@backend=7'", "option backend: expected str", "got 7"),
    (["demo", "--attention", "softmax@dropout=1"], "--attention 'softmax@dropout=1'",
     "option dropout: expected a value < 1", "got 1"),
]


@pytest.mark.parametrize("argv, where, expected, given", MECHANISM_CASES,
                         ids=[" ".join(c[0]) for c in MECHANISM_CASES])
def test_out_of_range_mechanism_option_is_a_usage_error(cli, tmp_path, argv, where, expected, given):
    import attnkit

    if getattr(attnkit.get_spec("softmax").resolved_options()[0], "minimum", "absent") == "absent":
        pytest.skip("this attnkit's option schema has no ranges")
    code, _, err = cli(*argv, "--out", str(tmp_path / "out"), "-q")
    assert code == 2, err
    assert where in err and expected in err and given in err and "Traceback" not in err, err
    assert not list(tmp_path.iterdir())
