"""The course's machinery: the exercise and bug catalog, loading the code under test, running the
exercise tests against it, grading, and the `course` command."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
