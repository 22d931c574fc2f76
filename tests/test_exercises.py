"""The exercise switch (chapters/exercises/), both ways: each chapter's grading tests pass with the
engine's own functions installed through the switch (the solutions), and fail with an untouched
skeleton, with the skeleton's message (which exercise, what to read), not a crash or a hang.

Each direction runs pytest in a subprocess with MINIVLLM_EXERCISE set, on a few of the chapter's
tests (`quick_tests`), under a timeout.
"""
import importlib
import inspect
import subprocess
from pathlib import Path

import pytest

from chapters.exercises import grading

REPO_ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600
EXERCISES = [(chapter, exercise) for chapter in grading.CHAPTERS.values() for exercise in chapter.exercises]


def _run_grading(spec: str, solutions: bool) -> subprocess.CompletedProcess:
    from chapters.exercises.__main__ import grading_environment, pytest_command

    # -v cancels pytest_command's -q, so that the header (which lists each replacement) is shown
    command = pytest_command(spec, quick=True, extra=["-v", "-p", "no:xdist", "--tb=short"])
    env = grading_environment(spec, solutions)
    env.pop("MINIVLLM_TEST_LOG", None)  # the grading run's outcomes are not this suite's (see tests/conftest.py)
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def test_grading_tests_pass_with_the_solutions():
    spec = ",".join(grading.CHAPTERS)
    run = _run_grading(spec, solutions=True)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-5000:]
    assert " passed" in output, output[-2000:]
    for _, exercise in EXERCISES:  # the switch was in effect (the header lists each replacement)
        for target in exercise.targets:
            assert f"exercise {exercise.number}: {target} <- the engine's own code" in output, output[:3000]


@pytest.mark.parametrize("chapter, exercise", EXERCISES, ids=[e.number for _, e in EXERCISES])
def test_untouched_skeleton_fails_with_its_message(chapter, exercise):
    run = _run_grading(exercise.number, solutions=False)
    output = run.stdout + run.stderr
    assert run.returncode == 1, f"expected failing tests (exit 1), got {run.returncode}:\n{output[-5000:]}"
    assert any(f"NotImplementedError: exercise {exercise.number} ({name}) is not written yet" in output
               for name in exercise.names), output[-5000:]
    assert chapter.chapter in output  # the message says what to read
    assert "INTERNALERROR" not in output, output[-5000:]


@pytest.mark.parametrize("chapter, exercise", EXERCISES, ids=[e.number for _, e in EXERCISES])
def test_skeleton_matches_the_engine_function(chapter, exercise):
    """Same parameters as each function it replaces; the chapter names it and `make exercise` in its end."""
    for target, name in zip(exercise.targets, exercise.names):
        _, _, engine_fn = grading._resolve(target)
        skeleton_fn = getattr(importlib.import_module(chapter.skeleton), name)
        engine_params = list(inspect.signature(grading._python_function(engine_fn)).parameters)
        assert list(inspect.signature(grading._python_function(skeleton_fn)).parameters) == engine_params, target
    text = (REPO_ROOT / chapter.chapter).read_text()
    assert f"make exercise CH={chapter.number}" in text, f"{chapter.chapter} does not point at its exercises"
    assert exercise.section in text, f"{chapter.chapter} has no section {exercise.section!r} ({exercise.number})"


def test_switch_rejects_unknown_exercises():
    with pytest.raises(ValueError, match="no exercises for chapter"):
        grading.select("99")
    with pytest.raises(ValueError, match="has no exercise"):
        grading.select("05.9")
    assert [e.number for _, e in grading.select("02,15.2")] == ["02.1", "02.2", "15.2"]
