"""scripts/ncu_hot_lines.py: the hottest CUDA lines of one kernel from ncu's source page."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ncu_hot_lines.py"
spec = importlib.util.spec_from_file_location("ncu_hot_lines", SCRIPT)
assert spec is not None and spec.loader is not None
hot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hot)

HEADER = (
    '"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)",'
    '"Instructions Executed","stall_barrier","stall_long_sb","stall_barrier (Not Issued)"'
)


def _page(tmp_path: Path) -> Path:
    # Two kernels, two files; SASS rows (an address) must not be counted twice.
    text = "\n".join(
        [
            '"File Path","/src/a.h"',
            '"Function Name","ns::planKernel(Args)"',
            HEADER,
            '"10","x = y;","-","-","30","1,000","25","5","99"',
            '"10","-","0x10","LDG.E R1","30","1000","25","5","99"',
            '"11","z = w;","-","-","5","10","0","5","0"',
            '"File Path","/src/b.cu"',
            '"Function Name","ns::planKernel(Args)"',
            HEADER,
            '"7","q();","-","-","40","7","0","40","0"',
            '"File Path","/src/c.cu"',
            '"Function Name","ns::otherKernel(Args)"',
            HEADER,
            '"1","big();","-","-","900","9","900","0","0"',
        ]
    )
    p = tmp_path / "source.csv"
    p.write_text(text + "\n")
    return p


def test_lines_are_summed_per_kernel_and_ranked(tmp_path):
    total, rows = hot.hot_lines(
        str(_page(tmp_path)), "planKernel", "Warp Stall Sampling (All Samples)"
    )
    assert total == 75  # the other kernel's 900 and the SASS row's 30 are not counted
    assert [(k, v) for k, v, _, _ in rows] == [("b.cu:7", 40), ("a.h:10", 30), ("a.h:11", 5)]
    assert rows[1][3] == "barrier=25, long_sb=5"  # "(Not Issued)" columns left out


def test_another_column_and_thousands_separators(tmp_path, capsys):
    page = _page(tmp_path)
    _, rows = hot.hot_lines(str(page), "planKernel", "Instructions Executed")
    assert rows[0][:2] == ("a.h:10", 1000)
    assert hot.main([str(page), "otherKernel", "--top", "1"]) == 0
    assert "c.cu:1" in capsys.readouterr().out
    assert hot.main([str(page), "missingKernel"]) == 1
