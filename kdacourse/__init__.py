"""The course's machinery: the exercise and bug catalog, loading the code under test, running the
exercise tests against it, grading, and the `course` command."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# A student handout (`course handout`, kdacourse/handout.py) holds this file at its root.
HANDOUT_MARKER = "HANDOUT.md"


def is_handout(root=REPO_ROOT):
    """Whether this copy of the course is a student handout: no solutions, the exercises stubbed."""
    return (Path(root) / HANDOUT_MARKER).is_file()
