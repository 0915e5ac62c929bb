"""No chunkwise exercise is answered by a token-by-token loop wrapped in a few lines.

Outputs cannot tell two right forms apart: reference A (recurrent) and reference C (kernel_mirror),
repaired, give reference B's o, and stage 6's reference A its gradients. So reference B returns, beside
its outputs, what only the chunked algorithm forms: the state as each chunk starts, each chunk's scores
A_qk and, with a delete term, its WY factors W and U (ChunkwiseOutput, stages 1-4); the gradients of
every chunk's scores A_qk and M (ChunkwiseGradients, stage 6). Each chunkwise exercise's tests check
them (tests/exercises/chunk_checks.py, tests/exercises/s06_backward/oracle.py). Three measures, for every
chunkwise exercise of the catalog:

- another exercise's repaired file wrapped: the token loop's outputs (and, forward, the states it holds
  at every chunk start), zeros where it has nothing: the exercise's value test passes on it, and its
  chunk test (CHUNK_TEST) fails;
- a fix exercise as shipped, its chunk quantities kept and its outputs taken from the repaired token
  loop: the chunk test fails (the bug it ships with reaches them);
- a second chunked answer written apart from the course's (tests/chunkwise_alternatives/, a folder laid
  out like exercises/) passes every test of the exercise: the checks hold any chunked form, not ours.
"""

import importlib
import subprocess
import sys

import numpy as np
import pytest

from kdacourse import REPO_ROOT
from kdacourse.catalog import exercises
from kdacourse.targets import load_module
from stages.common.inputs import Inputs
from tests.exercises.chunk_checks import expected_chunk_start_states

CHUNKWISE = [e for e in exercises() if e.file.startswith("chunkwise")]
ALTERNATIVES = REPO_ROOT / "tests" / "chunkwise_alternatives"
CHUNK_TEST = "test_returns_what_only_a_chunked_form_has"
FORWARD_CASE = dict(N=19, chunk_size=4)  # a case of the forward exercises' value and chunk tests
BACKWARD_CASE = dict(B=2, N=11, H=2, d_k=5, d_v=3, chunk_size=4)  # of stage 6's


def _tests(exercise):
    return importlib.import_module(f"tests.exercises.{exercise.stage}.test_{exercise.file.removesuffix('.py')}")


def _value_test(exercise):
    """The exercise's first test of its outputs against an oracle, on every shape it takes."""
    return next(getattr(_tests(exercise), name) for name in dir(_tests(exercise)) if name.startswith("test_matches"))


def _solution(stage, file):
    return getattr(load_module("solutions", stage, file), file.removesuffix(".py"))


def _forward_answer(stage, outputs, chunk_quantities=None):
    """A chunkwise built on another function: o = outputs(inputs, chunk_size); the chunk quantities from
    chunk_quantities(the same arguments), or else what a token loop holds (the state at every chunk
    start) and zeros for the rest."""
    record = importlib.import_module(f"stages.{stage}.reference").ChunkwiseOutput

    def chunkwise(*arguments):
        *inputs, chunk_size = arguments
        x = Inputs(*inputs)
        B, N, H, d_k = x.q.shape
        given = chunk_quantities(*arguments)._asdict() if chunk_quantities else {
            "chunk_start_states": expected_chunk_start_states(x, chunk_size), "A_qk": np.zeros((B, N, H, chunk_size)),
            "W": np.zeros((B, N, H, d_k)), "U": np.zeros(x.v.shape)}
        return record(o=outputs(inputs, chunk_size), **{name: given[name] for name in record._fields[1:]})

    return chunkwise


def _backward_answer(gradients, score_gradients=None):
    """A chunkwise_backward built on another function: its gradients, and dA_qk and dM from
    score_gradients (the same arguments), or else zeros."""
    from stages.s06_backward.reference import ChunkwiseGradients

    def chunkwise_backward(q, k, v, g, beta, do, chunk_size, initial_state=None, d_final_state=None):
        result = gradients(q, k, v, g, beta, do, initial_state, d_final_state)
        if score_gradients is None:
            zeros = np.zeros((*q.shape[:3], chunk_size))
            return ChunkwiseGradients(*result, zeros, zeros)
        given = score_gradients(q, k, v, g, beta, do, chunk_size, initial_state, d_final_state)
        return ChunkwiseGradients(*result, given.dA_qk, given.dM)

    return chunkwise_backward


def _wrapped_answers(exercise):
    """{description: a function in the exercise's place}: each other reference of its stage, repaired,
    wrapped in a few lines."""
    stage = exercise.stage
    if exercise.file == "chunkwise_backward.py":
        return {"s06.recurrent_backward, repaired": _backward_answer(_solution(stage, "recurrent_backward.py"))}
    recurrent, mirror = _solution(stage, "recurrent.py"), _solution(stage, "kernel_mirror.py")
    return {f"{exercise.id.split('.')[0]}.recurrent, repaired": _forward_answer(stage, lambda x, C: recurrent(*x)),
            f"{exercise.id.split('.')[0]}.kernel_mirror, repaired":
                _forward_answer(stage, lambda x, C: mirror(*x, C, x[2].shape[3]))}


CASES = [(exercise, description) for exercise in CHUNKWISE for description in _wrapped_answers(exercise)]


@pytest.mark.parametrize("exercise, description", CASES, ids=[f"{e.id}-{d.split(',')[0]}" for e, d in CASES])
def test_a_wrapped_token_loop_fails_the_chunk_test(exercise, description):
    answer = _wrapped_answers(exercise)[description]
    case = BACKWARD_CASE if exercise.file == "chunkwise_backward.py" else FORWARD_CASE
    _value_test(exercise)(answer, **case)  # right outputs: only the chunk quantities can tell
    with pytest.raises(AssertionError, match="never forms it"):
        getattr(_tests(exercise), CHUNK_TEST)(answer, **case)


FIX_EXERCISES = [e for e in CHUNKWISE if e.kind == "fix"]


@pytest.mark.parametrize("exercise", FIX_EXERCISES, ids=[e.id for e in FIX_EXERCISES])
def test_the_shipped_chunk_quantities_with_a_token_loop_fail(exercise):
    """The shipped file's chunk quantities (what the student holds) beside the repaired token loop's
    outputs: the bug the exercise ships with reaches them, so this is no way around the fix."""
    shipped = getattr(load_module("exercises", exercise.stage, exercise.file), exercise.file.removesuffix(".py"))
    if exercise.file == "chunkwise_backward.py":
        answer = _backward_answer(_solution(exercise.stage, "recurrent_backward.py"), shipped)
        case = BACKWARD_CASE
    else:
        recurrent = _solution(exercise.stage, "recurrent.py")
        answer = _forward_answer(exercise.stage, lambda x, C: recurrent(*x), shipped)
        case = FORWARD_CASE
    with pytest.raises(AssertionError):
        getattr(_tests(exercise), CHUNK_TEST)(answer, **case)


def test_a_second_chunked_answer_passes_every_test():
    """One pytest run of every chunkwise exercise's tests on tests/chunkwise_alternatives/."""
    for exercise in CHUNKWISE:
        assert (ALTERNATIVES / exercise.stage / exercise.file).is_file(), f"{exercise.id} has no second answer"
    run = subprocess.run([sys.executable, "-m", "pytest", *(str(e.test_path) for e in CHUNKWISE), "-q",
                          "-p", "no:cacheprovider", "-p", "no:xdist", f"--target={ALTERNATIVES}"],
                         cwd=REPO_ROOT, capture_output=True, text=True)
    assert run.returncode == 0, f"the chunkwise tests fail on {ALTERNATIVES.name}/:\n{run.stdout[-3000:]}"
