"""Stage 1's generated files: the error table of references B and C against A, the identities
table, the kernel's compile-only report at a few tile sizes, and the kernel's errors on the H200
(read from the committed GPU test log)."""

from kdacourse.pages.stage_tables import compile_report_table, gpu_log_table, identities_table
from kdacourse.pages.tables import ROUNDING_NOTE, banner, markdown_table, rounding_level
from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.s01_linear_attention.reference import chunkwise, kernel_mirror, recurrent

SOURCE = "kdacourse/pages/s01_linear_attention.py"

# B, N, H, d_k, d_v, chunk_size, block_dv: one chunk, many chunks, a padded last chunk, a realistic head
ERROR_TABLE_SHAPES = [
    (2, 16, 2, 4, 4, 16, 2),
    (2, 64, 2, 4, 4, 8, 2),
    (2, 50, 2, 8, 8, 16, 4),
    (1, 256, 2, 64, 64, 64, 32),
]


def write_error_table(path):
    rows = []
    for B, N, H, d_k, d_v, C, block_dv in ERROR_TABLE_SHAPES:
        x = make_inputs(B, N, H, d_k, d_v, seed=0)
        expected = recurrent(x.q, x.k, x.v)
        shape = f"B={B}, N={N}, H={H}, d_k={d_k}, d_v={d_v}, C={C}, block_dv={block_dv}"
        for name, actual in (("B chunkwise", chunkwise(x.q, x.k, x.v, C).o),
                             ("C kernel mirror", kernel_mirror(x.q, x.k, x.v, C, block_dv))):
            error = error_report(actual, expected)
            rows.append((shape, f"{name} vs A", rounding_level(error.max_abs), rounding_level(error.rel_l2)))
    path.write_text(banner(SOURCE) + markdown_table(["shape", "comparison", "max abs error", "relative L2"], rows)
                    + "\n" + ROUNDING_NOTE)


def write_identities_table(path):
    from stages.s01_linear_attention.identities import IDENTITIES

    path.write_text(identities_table(IDENTITIES, SOURCE))


# The test shape of the compile-only test, at the default tiles and at the alternatives one would try:
# wider value blocks (fewer programs, a bigger state fragment each) and longer chunks.
COMPILE_SHAPE = dict(B=2, N=1024, H=4, d_k=128, d_v=128)
COMPILE_TILES = [(64, 32), (64, 64), (64, 128), (128, 32)]  # (chunk_size, block_dv)


def write_compile_report(path):
    from stages.s01_linear_attention.kernel import compile_report

    reports = [({"chunk_size": C, "block_dv": block_dv}, compile_report(**COMPILE_SHAPE, chunk_size=C, block_dv=block_dv))
               for C, block_dv in COMPILE_TILES]
    path.write_text(compile_report_table(reports, SOURCE))


def write_gpu_errors(path):
    path.write_text(gpu_log_table("tests/gpu_results/s01_linear_attention.log", SOURCE))


def generated_files():
    return {
        "docs/generated/s01_gpu_errors.md": write_gpu_errors,
        "docs/generated/s01_errors.md": write_error_table,
        "docs/generated/s01_identities.md": write_identities_table,
        "docs/generated/s01_compile_report.md": write_compile_report,
    }
