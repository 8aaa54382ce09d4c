"""The launcher that retries a triton kernel with smaller tiles when it needs more shared memory than the GPU has.

No GPU is needed: a stand-in kernel raises an exception named ``OutOfResources`` (as triton's does) for
configurations over a budget, and records what was launched.
"""

from __future__ import annotations

import pytest

from attnkit_kernelized import _triton_fit
from attnkit_kernelized._triton_fit import launch, smaller


class OutOfResources(Exception):
    """Stands in for ``triton.runtime.errors.OutOfResources`` (matched by name)."""


class FakeKernel:
    """``kernel[grid](*args, **meta)``: fails when the tiles' product times the stages exceeds ``budget``."""

    def __init__(self, budget: int, name: str) -> None:
        self.budget, self.launched, self.__name__ = budget, [], name

    def __getitem__(self, grid):
        def run(*args, **meta):
            need = meta["BLOCK_L"] * meta["BLOCK_X"] * meta.get("num_stages", 3)
            if need > self.budget:
                raise OutOfResources(f"shared memory, Required: {need}, Hardware limit: {self.budget}")
            self.launched.append((grid, dict(meta)))
        return run


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    monkeypatch.setattr(_triton_fit, "_FITTED", {})


def test_smaller_drops_pipeline_stages_then_halves_the_largest_tile():
    meta = {"BLOCK_L": 64, "BLOCK_X": 256, "BLOCK_W": 64}
    first = smaller(meta, ("BLOCK_L", "BLOCK_W"))
    assert first == {**meta, "num_stages": 1}
    second = smaller(first, ("BLOCK_L", "BLOCK_W"))
    assert second == {**first, "BLOCK_L": 32}
    assert smaller({"BLOCK_L": 16, "num_stages": 1}, ("BLOCK_L",)) is None
    assert smaller({"BLOCK_L": 64, "num_stages": 1}, ()) is None


def test_a_kernel_that_fits_runs_once_as_asked():
    k = FakeKernel(10**9, "fits")
    ran = launch(k, lambda m: (2, 64 // m["BLOCK_L"]), ("x",), {"BLOCK_L": 64, "BLOCK_X": 256})
    assert ran == {"BLOCK_L": 64, "BLOCK_X": 256}
    assert k.launched == [((2, 1), ran)]


def test_out_of_resources_retries_with_one_stage_then_halved_tiles_on_the_grid_of_the_new_tiles():
    k = FakeKernel(64 * 256, "stages")                            # fits once pipelining is off
    ran = launch(k, lambda m: (1, 128 // m["BLOCK_L"]), (), {"BLOCK_L": 64, "BLOCK_X": 256}, shrink=("BLOCK_L",))
    assert ran == {"BLOCK_L": 64, "BLOCK_X": 256, "num_stages": 1}
    assert k.launched == [((1, 2), ran)]
    k = FakeKernel(32 * 256, "tiles")                             # needs the chunk halved too
    ran = launch(k, lambda m: (1, 128 // m["BLOCK_L"]), (), {"BLOCK_L": 64, "BLOCK_X": 256}, shrink=("BLOCK_L",))
    assert ran == {"BLOCK_L": 32, "BLOCK_X": 256, "num_stages": 1}
    assert k.launched == [((1, 4), ran)]                          # the grid follows the tiles


def test_remembered_configuration_is_used_first():
    k = FakeKernel(32 * 256, "remember")
    meta = {"BLOCK_L": 64, "BLOCK_X": 256}
    ran = launch(k, lambda m: (1,), (), meta, shrink=("BLOCK_L",))
    assert ran["BLOCK_L"] == 32 and ran["num_stages"] == 1
    k.launched.clear()
    k.budget = 10**9  # would now fit as asked, but the fitted configuration is reused without a failed try
    assert launch(k, lambda m: (1,), (), meta, shrink=("BLOCK_L",)) == ran
    assert k.launched == [((1,), ran)]


def test_nothing_smaller_left_raises_the_out_of_resources():
    k = FakeKernel(1, "hopeless")
    with pytest.raises(OutOfResources, match="shared memory"):
        launch(k, lambda m: (1,), (), {"BLOCK_L": 32, "BLOCK_X": 256}, shrink=("BLOCK_L",))


def test_other_errors_are_not_retried():
    class Broken:
        __name__ = "broken"
        calls = 0

        def __getitem__(self, grid):
            def run(*args, **meta):
                Broken.calls += 1
                raise ValueError("bad argument")
            return run

    with pytest.raises(ValueError, match="bad argument"):
        launch(Broken(), lambda m: (1,), (), {"BLOCK_L": 64}, shrink=("BLOCK_L",))
    assert Broken.calls == 1
