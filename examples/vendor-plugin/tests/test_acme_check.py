"""``kvcore check`` on the installed acme backend passes; on each defect of the broken variant (broken_acme.py) it
fails and names the check that caught it.  And with a second vendor's plugin installed, each vendor's backend
wins on its own hardware only."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def kvcore(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    for var in ("KVCORE_PLUGINS", "KVCORE_DISABLE_PLUGINS", "TRITON_INTERPRET"):
        env.pop(var, None)  # kvcore check sets up the interpreter (or compiled kernels) itself
    return subprocess.run([sys.executable, "-m", "kvcore.tools.cli", *args], env=env, capture_output=True, text=True)


def device_args() -> list[str]:
    return ["--device", "cuda"] if os.environ.get("KVCORE_TEST_COMPILED") == "1" else []


def test_kvcore_check_acme_passes():
    run = kvcore("check", "acme", *device_args())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr
    assert "kvcore check: passed" in run.stdout
    # every check is reported by name: pool checks per variant, the allocator per page size
    assert "ok    pool      mha       padding_page_untouched[bfloat16-" in run.stdout
    assert "ok    allocator mha       random_request_lifetimes[bfloat16-" in run.stdout


@pytest.mark.parametrize("defect, check, says", [
    ("wrong_row", "round_trip_only_target_rows_change", "k rows after writing"),
    ("padding", "padding_page_untouched", "padding page of buffer"),
    ("layout_bytes", "layout_bytes_equal_allocated_bytes", "buffer kv: shape"),
    ("overlapping_move", "move_matches_gather_then_scatter[bfloat16-triton-page4-shift]", "rows of the targets after a shift move"),
    ("twice", "random_request_lifetimes", "holds a location twice"),
])  # fmt: skip
def test_kvcore_check_names_what_a_broken_backend_gets_wrong(defect, check, says):
    """Each defect fails its check by name; only that check is run (``--only``: the whole kit runs in
    test_kvcore_check_acme_passes)."""
    run = kvcore("check", "acme_broken", "--plugin", "broken_acme", "--dtype", "bfloat16", "--page-size", "4",
                 "--kernels", "triton", "--only", check.split("[")[0], f"kv_cache.options.defect={defect}",
                 *device_args())  # fmt: skip
    assert run.returncode != 0
    failures = [line for line in run.stdout.splitlines() if line.lstrip().startswith("FAIL")]
    assert any(check in line and says in line for line in failures), run.stdout[-3000:] + run.stderr
    assert "kvcore check: FAILED" in run.stdout


@pytest.mark.parametrize("vendor, chosen", [("acme", "acme"), ("zeta", "zeta"), ("nvidia", "mha")])
def test_each_vendor_wins_on_its_own_hardware(vendor, chosen):
    run = kvcore("plugins", "--explain", "model=qwen2.5-0.5b", "hardware=cpu", f"hardware.vendor={vendor}")
    assert run.returncode == 0, run.stderr
    assert "plugins loaded: acme, " in run.stdout and ", zeta" in run.stdout  # both vendors' plugins installed
    assert f"selected backend '{chosen}'" in run.stdout
    if chosen == "acme":
        assert "skipped 'mha' (plugin mha): matches, but ranks lower" in run.stdout
        assert "skipped 'zeta' (plugin zeta): vendor acme not in [zeta]" in run.stdout
