"""Helpers of the tests that show a grading test rejects a known wrong answer (chapters/exercises/)."""
import pytest

from chapters.exercises import grading

# The wrong answers are the engine's code with one thing broken: skipped while a learner's code is installed.
builds_on_the_engine = pytest.mark.skipif(grading.installs_learners_code(),
                                          reason="checks the grader on wrong answers built from the engine's code")


def rejected(check, owner, name, wrong) -> None:
    """`check` (a grading test) fails with owner.name replaced by `wrong`."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(owner, name, wrong)
        with pytest.raises(AssertionError):
            check()


class KernelWithOnePieceBroken:
    """Stands in for an engine kernel: `kernel[grid](...)` launches `broken_copy`, the test's copy of the
    kernel whose constexpr BROKEN breaks the piece at that index of `pieces` ("nothing" breaks none)."""

    def __init__(self, broken_copy, pieces: list[str], piece: str):
        self.broken_copy, self.broken = broken_copy, pieces.index(piece)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.broken_copy[grid](*args, BROKEN=self.broken, **kwargs)


def case_id(x) -> str:
    """A parametrized case's id: a function by its name (tests without their prefix), a string as is."""
    return x.__name__.removeprefix("test_")[:40] if callable(x) else x
