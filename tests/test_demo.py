"""`make demo` runs this command; keep it working and keep its claims true."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.multiprocess
def test_demo_runs_on_the_zero_config_default(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "DLOCK_DEMO_DB": str(tmp_path / "demo.sqlite3"),
        "DLOCK_CELERY_DATA": str(tmp_path / "celery"),
    }
    for variable in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
        env.pop(variable, None)
    manage = [sys.executable, str(ROOT / "testproject" / "manage.py")]
    subprocess.run([*manage, "migrate", "--noinput", "-v0"], env=env, check=True)
    result = subprocess.run(
        [*manage, "dlock_demo", "--workers", "3", "--rounds", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "DatabaseBackend on sqlite" in out
    assert out.count("tokens strictly increasing in acquisition order: yes") == 3
    assert "order: NO" not in out
    assert "LockTimeout" in out
    assert "$ manage.py locks show report:daily" in out
    assert "holder.note         nightly report" in out
    assert re.search(r"^  BACKEND +NAME +TOKEN +HOLDER +HELD FOR +EXPIRES IN$", out, re.M)
    assert re.search(r"^  default +invoice:42 +\d+ +\S+:\d+ ", out, re.M)
    assert "No locks held." in out
    assert "acquired after" in out and "yes)" in out
    # The Celery act: a real worker, 8 duplicates per key, one body per key.
    for account in (1, 2, 3):
        assert f"report:{account}  ran 1 (token" in out
        assert "skipped 7  ok" in out
        assert f"sync:{account}  scope='queue': 8 calls enqueued 1 message(s)" in out
    assert re.search(r"^  default +report:1 +\d+ +\S+:\d+ demo\.tasks\.build_report\[", out, re.M)
    assert out.rstrip().endswith("No locks held.")
