"""The machine line every benchmark prints names the core, not only its extensions."""

from __future__ import annotations

from iterserve.bench.machine import cpu_line, cpu_model

ZEN5_VM = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: another core
"""

GRAVITON = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd asimddp
CPU implementer\t: 0x41
CPU part\t: 0xd40
"""


def test_the_first_processors_model_with_its_family_and_number() -> None:
    assert cpu_model(ZEN5_VM) == "AMD EPYC (family 26, model 2)"
    assert cpu_model(GRAVITON) == "Arm implementer 0x41 part 0xd40"
    assert cpu_model("") == ""


def test_the_line_carries_this_machines_model() -> None:
    line = cpu_line()
    assert line.startswith("cpu ") and "; kernels " in line
    assert cpu_model() in line
