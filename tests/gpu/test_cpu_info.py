"""The CPU's model and flags, and FMSERVE_CPU_ISA: a newer CPU made to take the AVX2-only paths."""

import os
import subprocess
import sys

import pytest

from fmserve import cli
from gpu import cpu_info, device

NEWER = ("avx512", "amx", "avx_vnni")


def test_native_keeps_every_flag_the_cpu_lists(monkeypatch):
    monkeypatch.delenv(cpu_info.ENV_CPU_ISA, raising=False)
    assert cpu_info.cpu_flag_list() == cpu_info.cpu_flag_list(capped=False)
    assert device.cpu_flags() == frozenset(cpu_info.cpu_flag_list())
    assert cpu_info.torch_isa_env() == {}


def test_the_avx2_cap_hides_avx512_amx_and_vnni_and_nothing_older(monkeypatch):
    monkeypatch.setenv(cpu_info.ENV_CPU_ISA, "avx2")
    every = cpu_info.cpu_flag_list(capped=False)
    capped = cpu_info.cpu_flag_list()
    assert not [f for f in capped if f.startswith(NEWER)]
    assert [f for f in every if not f.startswith(NEWER)] == list(capped)
    assert not device.cpu_has_native_bf16() and not device.cpu_has_amx()
    assert cpu_info.torch_isa_env() == {"ATEN_CPU_CAPABILITY": "avx2",
                                        "ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_an_unknown_cap_is_an_error_that_names_the_variable(monkeypatch, capsys):
    monkeypatch.setenv(cpu_info.ENV_CPU_ISA, "avx3")
    with pytest.raises(ValueError, match="FMSERVE_CPU_ISA='avx3'.*native, avx2"):
        cpu_info.cpu_isa()
    assert cli.main(["client", "--prompt", "x"]) == 2
    assert "FMSERVE_CPU_ISA='avx3'" in capsys.readouterr().err


def test_the_cli_caps_torch_before_it_loads(monkeypatch):
    monkeypatch.setenv(cpu_info.ENV_CPU_ISA, "avx2")
    for key in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.setenv(key, "placeholder")
        monkeypatch.delenv(key)
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"


def test_the_capped_process_builds_and_runs_the_avx2_loop():
    """A fresh process (the library is built once per process and cap) under the cap runs the
    AVX2 dot-product loop on a CPU that has AVX2, whatever newer units it has."""
    if "avx2" not in cpu_info.cpu_flag_list(capped=False):
        pytest.skip("this CPU has no AVX2")
    code = ("from gpu import c_library as k, cpu_info as c; "
            "print(k.kernel_isa(), c.cpu_isa())")
    env = dict(os.environ, **{cpu_info.ENV_CPU_ISA: "avx2"})
    env.pop("FMSERVE_NO_C_KERNEL", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    assert out == ["avx2", "avx2"]
