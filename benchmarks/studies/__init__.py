"""One-off studies: variants of a kernel timed against the committed one, a kernel's parts checked alone, a sweep
of tile sizes. Each answered a question once (its results and what was adopted are on the stage pages); they
stay runnable (`python -m benchmarks.studies.<name> --help`) so that the answer can be checked again. The
benchmarks a reader runs to reproduce the pages' tables are the modules of benchmarks/ itself."""
