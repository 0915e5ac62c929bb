"""The exercise and bug catalog, kdacourse/catalog/<stage>.toml, one file per stage.

[[exercise]]: one file that a student edits, exercises/<stage>/<file>, mirrored by
  solutions/<stage>/<file>; the two differ only between the "# EXERCISE BEGIN" and
  "# EXERCISE END" lines. Its tests are tests/exercises/<stage>/test_<file>.
  kind = "fill": the region raises NotImplementedError; kind = "fix": the region is the solution's
  with the catalog bug named by `bug` applied; kind = "tune": the region is a right but wasteful
  program, the solution's with the catalog "bug" named by `bug` applied (its tests grade the cost
  that stages.common.program_cost counts). `read` is the page section that explains it.
  `forbidden` (optional) lists what the exercise's text forbids, e.g. ["np.linalg.inv"].

[[bug]]: one known mistake. Applied to solutions/<stage>/<file> by replacing the text `find`
  (which must occur exactly once) by `replace`. `hides_when` says on which inputs the bug gives
  the right answer anyway: the tests must use inputs where it does not.
"""

import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kdacourse import REPO_ROOT, is_handout

CATALOG_DIR = Path(__file__).with_name("catalog")
SHIPS_A_BUG = ("fix", "tune")  # the kinds whose shipped region is the solution's with a catalog bug applied
REGION_BEGIN = "# EXERCISE BEGIN"
REGION_END = "# EXERCISE END"


@dataclass(frozen=True)
class Exercise:
    id: str
    stage: str
    file: str
    kind: str  # "fill", "fix" or "tune"
    points: int
    read: str  # docs page and section that explain it
    bug: str | None = None  # for kind = "fix" or "tune": the catalog bug (or waste) it ships with
    # what the exercise's text forbids, e.g. ("np.linalg.inv",): a submission that names one scores
    # zero (kdacourse.cheating), and in the grading sandbox each raises when called
    forbidden: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "forbidden", tuple(self.forbidden))

    @property
    def test_path(self):
        return REPO_ROOT / "tests" / "exercises" / self.stage / f"test_{self.file}"


@dataclass(frozen=True)
class Bug:
    id: str
    stage: str
    file: str
    mistake: str
    why_easy: str
    hides_when: str
    find: str
    replace: str

    def apply(self, source):
        """The solution's source with this bug in it; `find` must occur exactly once."""
        count = source.count(self.find)
        if count != 1:
            raise ValueError(f"bug {self.id}: its `find` text occurs {count} times in {self.stage}/{self.file}, expected once")
        return source.replace(self.find, self.replace)


@cache
def load_catalog():
    """(exercises by id, bugs by id), in catalog order."""
    exercises, bugs = {}, {}
    for path in sorted(CATALOG_DIR.glob("*.toml")):
        with open(path, "rb") as f:
            data = tomllib.load(f)
        for entry in data.get("exercise", []):
            _add_unique(exercises, Exercise(**entry), path)
        for entry in data.get("bug", []):
            _add_unique(bugs, Bug(**entry), path)
    for exercise in exercises.values():
        if exercise.kind not in ("fill", *SHIPS_A_BUG):
            raise ValueError(f"exercise {exercise.id}: kind must be fill, fix or tune, got {exercise.kind!r}")
        # a handout's catalog (kdacourse/handout.py) names no bug: the one a fix exercise ships is its answer
        ships_a_bug = exercise.kind in SHIPS_A_BUG
        if ships_a_bug != (exercise.bug is not None) and not (ships_a_bug and is_handout()):
            raise ValueError(f"exercise {exercise.id}: a fix or tune exercise names its bug, a fill exercise none")
        if exercise.bug is not None and exercise.bug not in bugs:
            raise ValueError(f"exercise {exercise.id}: unknown bug {exercise.bug!r}")
    return exercises, bugs


def _add_unique(table, item, path):
    if item.id in table:
        raise ValueError(f"{path.name}: id {item.id!r} is used twice in the catalog")
    table[item.id] = item


def exercises():
    return list(load_catalog()[0].values())


def bugs():
    return list(load_catalog()[1].values())


def exercises_of_stage(stage):
    return [e for e in exercises() if e.stage == stage]


def stages():
    """The stage folders that have exercises, in order."""
    return sorted({e.stage for e in exercises()})


def resolve_stage(name):
    """'s01', 's1', '01', '1' or 's01_linear_attention' -> 's01_linear_attention'."""
    for stage in stages():
        prefix = stage.split("_")[0]  # "s01"
        number = str(int(prefix[1:]))
        if name in (stage, prefix, prefix[1:], number, f"s{number}"):
            return stage
    raise ValueError(f"unknown stage {name!r}; stages: {', '.join(stages())}")
