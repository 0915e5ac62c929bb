"""The counted cost of a graded tune exercise: what a class leaderboard ranks.

A tune exercise (kind = "tune" in the catalog) is graded on the cost that stages.common.program_cost
counts from the student's program: global bytes, GEMM FLOPs, element-wise FLOPs and shared memory,
each within 5% of the course's kernel. Among the programs that pass, the counts still differ (a
program may beat the kernel); `counted_cost_of` gives them for one graded result, so that a gradebook
can show them beside the points:

    from kdacourse.leaderboard import counted_cost_of, leaderboard_cell
    cost = counted_cost_of(result, folder)            # result: a kdacourse.grading.ExerciseResult
    leaderboard_cell(cost)                            # "10,485,824 B, 603,979,776 + 3,280,944 FLOP, 57,600 B shared"

The student's program is built at the exercise's cost shape (COST_SHAPE in its test file), in the
sandbox unless trust: the grader never imports student code (kdacourse.remote), and the count runs in
the sandbox's analysis child, which runs none.
"""

import ast

from kdacourse.catalog import Exercise


def cost_shape(exercise: Exercise) -> tuple:
    """The shape (B, N, H, d_k, d_v) at which the exercise's tests count the cost: the COST_SHAPE of its
    test file, read from its source (the course's code imports no test)."""
    tree = ast.parse(exercise.test_path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["COST_SHAPE"]:
            return tuple(ast.literal_eval(node.value))
    raise ValueError(f"{exercise.test_path} has no COST_SHAPE = (B, N, H, d_k, d_v)")


def counted_cost_of(result, folder, trust=False):
    """The CountedCost (stages.common.program_cost) of the program in `folder`/<stage>/<file> for a graded
    tune exercise that passed (`result`: a kdacourse.grading.ExerciseResult), or None: another kind
    of exercise, or one that failed (its program may not build, or not be under the target).

    trust=False builds the program in the grading sandbox (kdacourse.remote), as `course grade-all`
    grades by default; trust=True imports it here, as `--trust` does."""
    exercise = result.exercise
    if exercise.kind != "tune" or not result.passed:
        return None
    from stages.common.program_cost import counted_cost

    shape = cost_shape(exercise)
    if trust:
        from kdacourse.targets import load_module

        return counted_cost(load_module(str(folder), exercise.stage, exercise.file).build_program(*shape))
    from kdacourse.remote import RemoteSession

    session = RemoteSession(folder, forbidden={(exercise.stage, exercise.file): exercise.forbidden})
    try:
        program = session.module(exercise.stage, exercise.file).build_program(*shape)
        return program.analyze(counted_cost)
    finally:
        session.close()


def leaderboard_cell(cost) -> str:
    """A gradebook cell for a CountedCost (or "" for None): bytes, GEMM + element-wise FLOPs, shared memory."""
    if cost is None:
        return ""
    return (f"{cost.global_bytes:,} B, {cost.gemm_flops:,} + {cost.elementwise_flops:,} FLOP, "
            f"{cost.shared_bytes:,} B shared")
