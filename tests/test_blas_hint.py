"""The startup tip about MLX's reference BLAS on Linux CPUs (pure logic, no server)."""

from servicer.engine.model import reference_blas_hint

WHEEL_BLAS = "7f20 r-xp 00000000 08:01 12 /venv/site-packages/mlx_cpu.libs/libblas-bd8a.so.3\n"
OPENBLAS = "7f30 r-xp 00000000 08:01 13 /usr/lib/x86_64-linux-gnu/libopenblas.so.0\n"


def test_reference_blas_on_cpu_gets_the_tip():
    hint = reference_blas_hint(WHEEL_BLAS, on_cpu=True)
    assert hint is not None and "LD_PRELOAD" in hint


def test_no_tip_once_openblas_is_preloaded():
    assert reference_blas_hint(WHEEL_BLAS + OPENBLAS, on_cpu=True) is None


def test_no_tip_off_the_cpu_or_without_the_wheel_blas():
    assert reference_blas_hint(WHEEL_BLAS, on_cpu=False) is None
    assert reference_blas_hint(OPENBLAS, on_cpu=True) is None
