"""scripts/install_torch.sh, which scripts/setup.sh sources: which torch build it asks pip for.

Each case runs `install_torch PYTHON` in bash with a fake PYTHON (it records each pip install it is
asked for, and answers the CPU index's probe as the case says: reached or not) and, for the GPU
case, a fake nvidia-smi on PATH that lists one GPU. Nothing is downloaded.
"""

import subprocess

import pytest

from kdacourse import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "install_torch.sh"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
FAKE_PYTHON = """\
#!/bin/sh
# -c: the CPU index's probe, reached when CPU_INDEX_REACHED=1; -m pip ...: recorded
if [ "$1" = "-c" ]; then
  [ "$3" = "{index}/torch/" ] || exit 3
  [ "$CPU_INDEX_REACHED" = 1 ]
  exit $?
fi
echo "$@" >> "{log}"
"""
FAKE_NVIDIA_SMI = """\
#!/bin/sh
[ "$1" = "-L" ] && echo "GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000000)"
"""


def _executable(path, text):
    path.write_text(text)
    path.chmod(0o755)


def run_install_torch(tmp_path, gpu, cpu_index_reached):
    """(the pip commands the fake Python was given, the function's output)."""
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir()
    log = tmp_path / "pip.log"
    _executable(bin_folder / "python", FAKE_PYTHON.format(index=CPU_INDEX, log=log))
    if gpu:
        _executable(bin_folder / "nvidia-smi", FAKE_NVIDIA_SMI)
    command = f'set -euo pipefail; source "{SCRIPT}"; install_torch "{bin_folder / "python"}"'
    environment = {"PATH": f"{bin_folder}:/usr/bin:/bin", "CPU_INDEX_REACHED": "1" if cpu_index_reached else "0"}
    completed = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=environment, timeout=60)
    assert completed.returncode == 0, completed.stderr
    return (log.read_text().splitlines() if log.exists() else []), completed.stdout


@pytest.mark.parametrize("gpu, cpu_index_reached, expected", [
    (False, True, f"-m pip install -q torch==2.13.0 --index-url {CPU_INDEX}"),
    (False, False, "-m pip install -q torch==2.13.0"),
    (True, True, "-m pip install -q torch==2.13.0"),
], ids=["no GPU: the CPU index", "no GPU, the CPU index unreachable: the default index", "a GPU: the default index"])
def test_torch_comes_from_the_index_that_fits_the_machine(tmp_path, gpu, cpu_index_reached, expected):
    installs, output = run_install_torch(tmp_path, gpu, cpu_index_reached)
    assert installs == [expected], output
    if not gpu and not cpu_index_reached:
        assert "cannot be reached" in output


def test_setup_sources_the_choice_and_pins_torch_once():
    setup = (REPO_ROOT / "scripts" / "setup.sh").read_text()
    assert "source scripts/install_torch.sh" in setup and 'install_torch "$venv/bin/python"' in setup
    assert "torch==" not in setup  # the pin lives in install_torch.sh alone
    syntax = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
