"""The exercises as shipped, made from the solutions and the catalog.

A fill exercise is its solution with the region's body replaced by a NotImplementedError; a fix
exercise is its solution with its catalog bug applied, a tune exercise with its wasteful program. `python -m kdacourse.shipped` rewrites
exercises/ from solutions/ (instructors run it after changing a solution or the catalog); the test
suite checks that exercises/ is what this produces.
"""

import sys

from kdacourse import REPO_ROOT
from kdacourse.catalog import REGION_BEGIN, REGION_END, SHIPS_A_BUG, exercises, load_catalog


def split_region(source, where="source"):
    """(before, region, after): the text before the BEGIN line (inclusive), inside, from END on."""
    lines = source.splitlines(keepends=True)
    begins = [i for i, line in enumerate(lines) if line.strip() == REGION_BEGIN]
    ends = [i for i, line in enumerate(lines) if line.strip() == REGION_END]
    if len(begins) != 1 or len(ends) != 1 or begins[0] > ends[0]:
        raise ValueError(f"{where}: expected one '{REGION_BEGIN}' line followed by one '{REGION_END}' line")
    begin, end = begins[0], ends[0]
    return "".join(lines[: begin + 1]), "".join(lines[begin + 1 : end]), "".join(lines[end:])


def shipped_source(exercise):
    """The text of exercises/<stage>/<file> as the course ships it."""
    solution_path = REPO_ROOT / "solutions" / exercise.stage / exercise.file
    solution = solution_path.read_text()
    if exercise.kind in SHIPS_A_BUG:
        bug = load_catalog()[1][exercise.bug]
        shipped = bug.apply(solution)
        if split_region(shipped, str(solution_path))[1] == split_region(solution, str(solution_path))[1]:
            raise ValueError(f"{exercise.id}: bug {bug.id} changes nothing inside the exercise region")
        return shipped
    before, _, after = split_region(solution, str(solution_path))
    indent = before.splitlines()[-1][: -len(before.splitlines()[-1].lstrip())]
    todo = f'{indent}raise NotImplementedError("{exercise.id}: fill this region; see the docstring and the page")\n'
    return before + todo + after


def main(argv=None):
    for exercise in exercises():
        path = REPO_ROOT / "exercises" / exercise.stage / exercise.file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(shipped_source(exercise))
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
