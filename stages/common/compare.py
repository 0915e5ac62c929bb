"""Comparing an answer with the expected array, with a failure message that points toward the bug.

`assert_close` raises an AssertionError that says, in a few lines and without printing any array:
the shapes (each axis named), the error against its tolerance, the largest error and where the
first wrong entry is (batch, token, head, channel; with a chunk size also the chunk and the row in
it), which indices the wrong entries span, and, over chunks, whether the first chunk is right and
later ones wrong (what carries from one chunk to the next) or every chunk is wrong (inside a chunk).
`assert_rule` does the same for a structural rule: it names the rule that broke.
"""

import numpy as np

from stages.common.errors import error_report

# The course's layout of token arrays: (B, N, H, D).
TOKEN_AXES = ("batch", "token", "head", "channel")


def assert_close(actual, expected, *, rel_l2=None, max_abs=None, rtol=None, atol=0.0, name="the output",
                 axes=None, chunk_size=None):
    """Raise AssertionError unless `actual` matches `expected` within every tolerance given.

    rel_l2: bound on ||actual - expected||_2 / ||expected||_2 (error_report's measure);
    max_abs: bound on max |actual - expected|;
    rtol, atol: an entry-wise bound |actual - expected| <= atol + rtol |expected|, as np.isclose.
    axes names the axes (default: batch, token, head, channel for 4-d arrays); chunk_size maps the
    "token" axis to (chunk, row in chunk). NaN or inf in `actual` always fails.
    """
    __tracebackhide__ = True  # pytest shows the test's line, not this helper's
    if rel_l2 is None and max_abs is None and rtol is None:
        raise TypeError("assert_close needs a tolerance: rel_l2, max_abs or rtol")
    expected = _float_array(expected, "the expected value")
    try:
        actual = _float_array(actual, name)
    except TypeError as error:
        raise AssertionError(str(error)) from None
    axes = _axis_names(expected.ndim, axes)
    if actual.shape != expected.shape:
        raise AssertionError(f"{name} has shape {_shape(actual.shape, _axis_names(actual.ndim, axes))}, "
                             f"expected {_shape(expected.shape, axes)}")
    error = np.abs(actual - expected)
    finite = np.isfinite(actual)
    report = error_report(actual, expected)
    failed = []  # the tolerances that are not met, each as "measure value > bound"
    wrong = ~finite
    if rel_l2 is not None:
        if not report.rel_l2 <= rel_l2:
            failed.append(f"rel L2 error {report.rel_l2:.2e} > {rel_l2:g}")
        # an entry off by more than rel_l2 times the RMS of `expected`: if the rel L2 bound is
        # broken, at least one entry is
        scale = float(np.sqrt(np.mean(expected**2))) if expected.size else 0.0
        wrong = wrong | (error > rel_l2 * scale)
    if max_abs is not None:
        if not report.max_abs <= max_abs:
            failed.append(f"max abs error {report.max_abs:.2e} > {max_abs:g}")
        wrong = wrong | (error > max_abs)
    if rtol is not None:
        beyond = error > atol + rtol * np.abs(expected)
        if (beyond | ~finite).any():
            failed.append(f"{int((beyond | ~finite).sum())} of {error.size} entries off by more than "
                          f"{atol:g} + {rtol:g} |expected|")
        wrong = wrong | beyond
    if not failed and finite.all():
        return
    lines = [f"{name}, shape {_shape(actual.shape, axes)}: " + ("; ".join(failed) or "not finite")]
    unwritten = [] if finite.all() else _never_written(actual, axes, chunk_size)
    if not finite.all():
        lines.append(f"{_count(int((~finite).sum()), 'entry is', 'entries are')} NaN or inf, the first at "
                     f"{_where(_first(~finite, axes), axes, chunk_size)}")
        lines.extend(unwritten)
    else:
        largest = np.unravel_index(int(np.argmax(error)), error.shape)
        lines.append(f"largest error {float(error[largest]):.2e} at {_where(largest, axes, chunk_size)}")
    if wrong.any():
        lines.append(f"first wrong entry at {_where(_first(wrong, axes), axes, chunk_size)}")
        lines.append(f"{int(wrong.sum())} of {wrong.size} entries wrong, {_span(wrong, axes)}")
        # entries never written say nothing of which chunk's arithmetic to suspect
        hint = "" if unwritten else _chunk_hint(wrong, axes, chunk_size)
        if hint:
            lines.append(hint)
    raise AssertionError("\n".join(lines))


def assert_rule(holds, rule, detail=""):
    """Raise AssertionError naming `rule` (one sentence: what must hold) unless `holds`."""
    __tracebackhide__ = True
    if not holds:
        raise AssertionError(f"rule broken: {rule}" + (f"\n{detail}" if detail else ""))


def _never_written(actual, axes, chunk_size):
    """A line on the entries of `actual` that a program run by the tile interpreter never stored (they
    keep the NaN it allocates outputs with), or none: such a NaN is no overflow."""
    from stages.common.interpreter import never_written

    unwritten = never_written(actual)
    if not unwritten.any():
        return []
    return [f"{_count(int(unwritten.sum()), 'of them was', 'of them were')} never written by the program, the "
            f"first at {_where(_first(unwritten, axes), axes, chunk_size)}: a store it did not make, or made out "
            "of range, where it is dropped (read the interpreter page, \"A store or load out of range\")"]


def _float_array(x, name):
    if x is None:
        raise TypeError(f"{name} is None: did the function return its result?")
    if hasattr(x, "detach"):  # a torch tensor: to the host without importing torch here
        x = x.detach().cpu().double().numpy()
    try:
        array = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name} is not an array of numbers: got {type(x).__name__}") from None
    return array


def _axis_names(ndim, axes):
    if axes is not None and len(axes) == ndim:
        return tuple(axes)
    if axes is None and ndim == len(TOKEN_AXES):
        return TOKEN_AXES
    return tuple(f"axis {i}" for i in range(ndim))


def _shape(shape, axes):
    """(2, 32, 3, 6) -> '(batch=2, token=32, head=3, channel=6)'."""
    return "(" + ", ".join(f"{axis}={size}" for axis, size in zip(axes, shape)) + ")"


def _first(mask, axes):
    """The index of the first True entry, in token order when there is a token axis."""
    order = list(range(mask.ndim))
    if "token" in axes:  # causality: an error shows first at the earliest token, then spreads
        order.remove(axes.index("token"))
        order.insert(0, axes.index("token"))
    flat = np.transpose(mask, order)
    position = np.unravel_index(int(np.argmax(flat)), flat.shape)
    index = [0] * mask.ndim
    for axis, value in zip(order, position):
        index[axis] = int(value)
    return tuple(index)


def _where(index, axes, chunk_size):
    """'batch 0, token 9 (chunk 1, row 1), head 2, channel 0'."""
    parts = []
    for axis, value in zip(axes, index):
        part = f"{axis} {int(value)}"
        if axis == "token" and chunk_size:
            part += f" (chunk {int(value) // chunk_size}, row {int(value) % chunk_size})"
        parts.append(part)
    return ", ".join(parts)


def _runs(indices):
    """[1, 2, 3, 5] -> '1..3, 5'."""
    runs, start = [], None
    for i, value in enumerate(indices):
        if start is None:
            start = value
        if i + 1 == len(indices) or indices[i + 1] != value + 1:
            runs.append(f"{start}" if start == value else f"{start}..{value}")
            start = None
    return ", ".join(runs)


def _span(wrong, axes):
    """Which indices of each axis hold a wrong entry: 'at token 8..31 (of 32), every batch, head, channel'."""
    partial, every = [], []
    for axis_number, axis in enumerate(axes):
        other = tuple(i for i in range(wrong.ndim) if i != axis_number)
        hit = np.flatnonzero(wrong.any(axis=other))
        if len(hit) == wrong.shape[axis_number]:
            every.append(axis)
        else:
            partial.append(f"{axis} {_runs(list(hit))} (of {wrong.shape[axis_number]})")
    text = "at " + ", ".join(partial) if partial else "at every index"
    if partial and every:
        text += ", every " + ", ".join(every)
    return text


def _chunk_hint(wrong, axes, chunk_size):
    """First chunk against later chunks: which part of the computation to suspect."""
    if not chunk_size or "token" not in axes:
        return ""
    token_axis = axes.index("token")
    other = tuple(i for i in range(wrong.ndim) if i != token_axis)
    wrong_tokens = wrong.any(axis=other)
    chunks = [bool(wrong_tokens[start:start + chunk_size].any()) for start in range(0, len(wrong_tokens), chunk_size)]
    if len(chunks) < 2:
        return "one chunk only: the error is inside the chunk"
    wrong_chunks = [i for i, is_wrong in enumerate(chunks) if is_wrong]
    if not chunks[0]:
        return (f"chunk 0 is right, chunks {_runs(wrong_chunks)} (of 0..{len(chunks) - 1}) are wrong: "
                f"suspect what one chunk hands to the next (the state)")
    if all(chunks):
        return "every chunk is wrong, chunk 0 included: suspect the work inside a chunk, not only the state"
    right_chunks = [i for i, is_wrong in enumerate(chunks) if not is_wrong]
    return (f"chunk 0 is wrong; of chunks 0..{len(chunks) - 1}, {_runs(wrong_chunks)} wrong, "
            f"{_runs(right_chunks)} right")


def _count(n, one, many):
    return f"1 {one}" if n == 1 else f"{n} {many}"
