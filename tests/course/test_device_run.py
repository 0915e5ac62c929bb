"""scripts/device_run.sh, the wrapper every device call runs through (CONTRIBUTING.md, "Sparing the GPU's
time"), run here on stand-ins: a .gpu/env.sh that sets nothing, a Triton cache of one autotuning result
and one compiled kernel, the scratch folders under the test's own directory (DEVICE_RUN_SCRATCH)."""

import io
import os
import shutil
import subprocess
import tarfile

import pytest

from kdacourse import REPO_ROOT

AUTOTUNE = "HASHED/chunk_gla_fwd_kernel_o.autotune.json"
KERNEL = "HASHED/chunk_gla_fwd_kernel_o.cubin"


def _tar(path, files):
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _names(path):
    with tarfile.open(path) as tar:
        return sorted(name.removeprefix("./") for name in tar.getnames() if tar.getmember(name).isfile())


@pytest.fixture
def run(tmp_path):
    missing = [tool for tool in ("bash", "tar", "gzip", "timeout") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (the device's tools)")
    repo, out = tmp_path / "repo", tmp_path / "out"
    (repo / ".gpu").mkdir(parents=True)
    (repo / "scripts").mkdir()
    out.mkdir()
    shutil.copy(REPO_ROOT / "scripts" / "device_run.sh", repo / "scripts")
    (repo / ".gpu" / "env.sh").write_text("true\n")
    env = {"PATH": os.environ["PATH"], "OUT": str(out), "DEVICE_RUN_SCRATCH": str(tmp_path / "scratch")}

    def device_run(*arguments):
        return subprocess.run(["bash", "scripts/device_run.sh", *arguments], cwd=repo, env=env,
                              capture_output=True, text=True, timeout=60)

    return device_run, repo, out


def test_the_command_s_status_output_and_the_triton_caches_come_back(run):
    device_run, repo, out = run
    _tar(repo / "cache.tgz", {AUTOTUNE: '{"key": [60, 32]}', KERNEL: "binary"})
    done = device_run("--triton", "cache.tgz", "--", 'ls "$TRITON_CACHE_DIR"/HASHED; echo ran > "$RUN_OUT/mine"; exit 3')
    assert done.returncode == 3
    assert "chunk_gla_fwd_kernel_o.autotune.json" in done.stdout and "exit 3" in done.stdout
    assert _names(out / "results.tar.gz") == ["device_run.log", "mine"]
    assert _names(out / "triton_autotune.tgz") == [AUTOTUNE]  # the autotuning alone, in its folder
    assert _names(out / "triton.tgz") == sorted([AUTOTUNE, KERNEL])


def test_bad_arguments_are_refused(run):
    device_run, _, _ = run
    assert device_run("--tritonn", "x", "--", "true").returncode == 2
    assert device_run("--triton", "x.tgz").returncode == 2  # no command
