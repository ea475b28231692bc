"""docs/walkthrough.md, run as written: two daemons sharing an S3 bucket
(Ceph's RADOS Gateway on loopback, as the tests start it) and a peer pair."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT
from tests.ports import free_port
from tests.s3server import ProxiedS3

DOC = ROOT / "docs" / "walkthrough.md"


def test_the_walkthrough_runs_as_written(s3: ProxiedS3, tmp_path: Path) -> None:
    blocks = re.findall(r"^```sh\n(.*?)^```", DOC.read_text(), flags=re.M | re.S)
    assert len(blocks) >= 4
    script = "set -euo pipefail\n" + "\n".join(blocks)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "S3_ENDPOINT": s3.endpoint,
        "S3_BUCKET": s3.new_bucket(),
        "AWS_ACCESS_KEY_ID": s3.access_key,
        "AWS_SECRET_ACCESS_KEY": s3.secret_key,
        "PEER_PORT_C": str(free_port()),
        "PEER_PORT_D": str(free_port()),
    }
    out = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "B read A's block through S3" in out.stdout
    assert "D read C's block from its peer" in out.stdout
    # the block really went through the bucket
    listed = s3.boto().list_objects_v2(Bucket=env["S3_BUCKET"], Prefix="walkthrough/")
    assert [o["Key"] for o in listed.get("Contents", [])] == ["walkthrough/6b6579"]
