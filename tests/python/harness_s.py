"""Where the tests find the `harness-s` binary: $HARNESS_S_BIN, else the debug build in
$CARGO_TARGET_DIR (or ./target)."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def harness_s_bin() -> str:
    path = os.environ.get("HARNESS_S_BIN")
    if path:
        return path
    target = os.environ.get("CARGO_TARGET_DIR", str(ROOT / "target"))
    return str(Path(target) / "debug" / "harness-s")
