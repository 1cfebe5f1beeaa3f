"""The benchmark tools' fixture files: built in a child, so that the timing process never runs torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from clef_gguf.check.validate import validate

CHILD = """
import json, sys
from pathlib import Path
from clef_gguf.testing.fixture_files import benchmark_files
paths = benchmark_files(Path(sys.argv[1]), ["f32", "q8_0"])
print(json.dumps({"paths": {t: str(p) for t, p in paths.items()}, "torch": "torch" in sys.modules}))
"""


@pytest.mark.slow
def test_benchmark_files_are_complete_and_leave_torch_out_of_the_caller(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["torch"] is False  # torch ran in the builder's process only
    assert set(result["paths"]) == {"f32", "q8_0"}
    for path in result["paths"].values():
        report = validate(path)
        assert report.ok, report.summary
