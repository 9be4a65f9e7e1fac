"""train.mixed_precision=auto: bf16 only where the hardware computes it (distill/precision.py)."""
import pytest

from distill.precision import cpu_flags, cpu_has_native_bf16, resolve_mixed_precision

XEON_NO_BF16 = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw avx512_vnni\nprocessor\t: 1\n"
EPYC_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
SAPPHIRE = "flags\t\t: avx512f amx_tile amx_bf16 amx_int8\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_cpu_flags_reads_the_first_flags_line():
    assert cpu_flags(XEON_NO_BF16) == {"fpu", "sse", "avx2", "avx512f", "avx512bw", "avx512_vnni"}
    assert cpu_flags("") == set()
    assert "bf16" in cpu_flags(ARM)


@pytest.mark.parametrize("info,native", [(XEON_NO_BF16, False), (EPYC_BF16, True), (SAPPHIRE, True), (ARM, True),
                                         ("", False)])
def test_native_bf16_from_flags(info, native):
    assert cpu_has_native_bf16(cpu_flags(info)) is native


def test_auto_resolves_by_device_and_hardware():
    assert resolve_mixed_precision("auto", "cpu", cpu_bf16=False) == "no"
    assert resolve_mixed_precision("auto", "cpu", cpu_bf16=True) == "bf16"
    assert resolve_mixed_precision("auto", "cuda", cuda_bf16=True) == "bf16"
    assert resolve_mixed_precision("auto", "cuda", cuda_bf16=False) == "fp16"


@pytest.mark.parametrize("setting", ["no", "bf16", "fp16"])
def test_explicit_settings_pass_through(setting):
    assert resolve_mixed_precision(setting, "cpu", cpu_bf16=False) == setting
    assert resolve_mixed_precision(setting, "cuda", cuda_bf16=False) == setting


def test_this_machine_resolves_without_error():
    assert resolve_mixed_precision("auto", "cpu") in ("no", "bf16")


def test_accelerator_precision_refuses_fp16_on_cpu_and_resolves_auto():
    from omegaconf import OmegaConf

    from distill.config import SetupError
    from distill.precision import accelerator_precision

    with pytest.raises(SetupError, match="fp16 needs a CUDA GPU"):
        accelerator_precision(OmegaConf.create({"cpu": True, "mixed_precision": "fp16"}))
    precision, cpu = accelerator_precision(OmegaConf.create({"cpu": True, "mixed_precision": "auto"}))
    assert cpu and precision == resolve_mixed_precision("auto", "cpu")
    assert accelerator_precision(OmegaConf.create({"cpu": True, "mixed_precision": "bf16"})) == ("bf16", True)
