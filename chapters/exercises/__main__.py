"""Grade a chapter's exercises: `python -m chapters.exercises 05` (or `make exercise CH=05`).

Runs the chapter's grading tests (chapters/exercises/grading.py) with MINIVLLM_EXERCISE set, so
they test the functions in the chapter's skeleton file instead of the engine's. Run from the
repository root. Extra arguments after `--` go to pytest (e.g. `-- -x -k causal`).
"""
import argparse
import os
import subprocess
import sys
from pathlib import Path

from chapters.exercises.grading import CHAPTERS, ENV_EXERCISE, ENV_SOLUTIONS, select, test_ids

REPO_ROOT = Path(__file__).resolve().parents[2]


def pytest_command(spec: str, quick: bool = False, extra=()) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *test_ids(spec, quick), *extra]


def grading_environment(spec: str, solutions: bool = False) -> dict:
    env = dict(os.environ, **{ENV_EXERCISE: spec})
    env.pop(ENV_SOLUTIONS, None)
    if solutions:
        env[ENV_SOLUTIONS] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")  # the tests' shapes are small; threads only add waiting
    return env


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exercise", nargs="?", help="a chapter (05), one exercise (05.1), or several (03,04)")
    parser.add_argument("--solutions", action="store_true", help="grade the engine's own functions instead")
    parser.add_argument("--quick", action="store_true", help="only the few tests the CI check runs")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before the tests are stopped")
    parser.add_argument("--list", action="store_true", help="list the exercises and their tests")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    if args.list or not args.exercise:
        for chapter in CHAPTERS.values():
            print(f"chapter {chapter.number} ({chapter.chapter}), skeleton {chapter.skeleton.replace('.', '/')}.py")
            for exercise in chapter.exercises:
                print(f"  {exercise.number}  {', '.join(exercise.targets)}  (section \"{exercise.section}\")")
            print(f"  tests: {' '.join(chapter.tests)}")
        return 0
    try:
        select(args.exercise)
    except ValueError as e:
        parser.error(str(e))
    command = pytest_command(args.exercise, args.quick, extra)
    print(f"{ENV_EXERCISE}={args.exercise}{f' {ENV_SOLUTIONS}=1' if args.solutions else ''} {' '.join(command[1:])}",
          flush=True)
    try:
        return subprocess.run(command, cwd=REPO_ROOT, env=grading_environment(args.exercise, args.solutions),
                              timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"the tests took longer than {args.timeout:.0f} s and were stopped: does a loop in your code "
              f"never end?", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
