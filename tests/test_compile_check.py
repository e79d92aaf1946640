"""Offline NVRTC compile of every kernel variant, sm_80 and sm_90a, no GPU needed."""

import pytest

from kbit_cupy import _jit


def _nvrtc_available() -> bool:
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception:  # noqa: BLE001
        return False
    return bool(_jit.cuda_include_dirs())


@pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC and CUDA headers not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_every_variant_compiles_without_spills(arch):
    results = _jit.compile_check([arch])
    assert len(results) == len(_jit.variants_for(arch))
    # not ok: spills, wgmma serialized by ptxas, or a warp-specialised variant
    # whose registers are not the entry cap its setmaxnreg budgets assume
    failed = [(r.variant.name, r.spill_bytes, r.log[-2000:]) for r in results if not r.ok]
    assert not failed, failed
    assert all(r.registers > 0 for r in results)
    if arch == "sm_90a":
        # every wgmma launch's static + dynamic shared memory fits a CTA (227 KB on sm_90)
        for r in results:
            args = r.variant.args
            if r.variant.family == "gemm_mma" and len(args) >= 6 and args[5] > 0:
                itemsize = 2
                dynamic = _jit.gemm_wg_shared_bytes(args[3], args[5], itemsize)
                grouped = len(args) > 6 and bool(args[6])
                dynamic += _jit.gemm_prmt_table_bytes(args[0], args[3], args[5], grouped, 4)
                assert r.smem_bytes + dynamic <= 227 * 1024, (r.variant.name, r.smem_bytes, dynamic)


def test_kernel_names_are_spelled_one_way():
    assert _jit.kernel_name("quantize", 4, "float16", "uint8", False) == (
        "kbit::kbit_quantize<4, __half, unsigned char, false>"
    )
    assert _jit.kernel_name("dequantize", 2, "bfloat16", "float16") == (
        "kbit::kbit_dequantize<2, __nv_bfloat16, __half>"
    )


def test_headers_are_inlined_into_the_hashed_source():
    source = _jit.render_source("quantize")
    assert '#include "common.cuh"' not in source
    assert "e4m4_encode" in source


def test_compiled_variant_index(tmp_path, monkeypatch, capsys):
    # get_kernel records each compile next to CuPy's hashed cache files; info reads it.
    from kbit_cupy import _jit
    from kbit_cupy.__main__ import main

    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))
    assert _jit.compiled_variants() == []
    name = _jit.kernel_name("gemm_mma", 4, "float16", "uint8", 1, 1)
    for _ in range(2):  # a second process compiling the same variant adds a duplicate line
        _jit._note_compiled(name, "sm_90")
    _jit._note_compiled(_jit.kernel_name("quantize", 2, "float32", "float16", True), "sm_80")
    assert _jit.compiled_variants() == [
        ("sm_80", "kbit::kbit_quantize<2, float, __half, true>"),
        ("sm_90", "kbit::kbit_gemm_mma<4, __half, unsigned char, 1, 1>"),
    ]
    assert main(["info", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "variants compiled into the cache: 2: quantize 1 (sm_80), gemm_mma 1 (sm_90)" in out
    assert "sm_90  kbit::kbit_gemm_mma<4, __half, unsigned char, 1, 1>" in out


def test_setmaxnreg_budgets_fit_the_entry_allocation():
    # gemm_mma.cu's kConsumerRegs / kProducerRegs: setmaxnreg moves registers
    # within the CTA's allocation (threads x entry cap); asking for more hangs.
    for k in (2, 3, 4, 5):
        for m_tiles in _jit.gemm_wg_m_tiles(k, "uint8"):
            wgs = _jit.gemm_wg_warpgroups(m_tiles, k)
            threads = _jit.gemm_wg_threads(m_tiles, wgs)
            if threads == 128 * wgs:
                continue
            cap = _jit.gemm_wg_entry_regs(m_tiles, wgs)
            assert cap == 65536 // threads // 8 * 8
            consumer = (cap * (wgs + 1) - 24) // wgs // 8 * 8
            producer = cap * (wgs + 1) - wgs * consumer
            assert 24 <= producer <= 256 and producer % 8 == 0
            assert wgs * consumer + producer <= cap * (wgs + 1)
            assert consumer >= 232, (m_tiles, wgs, consumer)  # 128 accumulators plus decode


@pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC and CUDA headers not installed")
@pytest.mark.parametrize("m_tiles", [4, 8, 16])
def test_dense_hopper_pair_table_where_gemm_py_adds_its_shared_memory(m_tiles):
    """k = 4 on the dense Hopper path: the kernel reads the 64 KB PRMT table
    from dynamic shared memory (its 32 KB static pair table gone) exactly for
    the n8 tiles where gemm.py adds the 64 KB, and the sum fits a CTA."""
    wgs = _jit.gemm_wg_warpgroups(m_tiles, 4)
    (res,) = _jit.compile_check(["sm_90a"], [_jit.Variant("gemm_mma", (4, "float16", "uint8",
                                                                       m_tiles, 1, wgs))])
    assert res.ok, res.log
    table = _jit.gemm_prmt_table_bytes(4, m_tiles, wgs, False, 4)
    assert (res.smem_bytes < 1024) == (table > 0), (m_tiles, res.smem_bytes)
    assert table == (_jit.PRMT_TABLE_BYTES if m_tiles <= 8 else 0)
    assert res.smem_bytes + _jit.gemm_wg_shared_bytes(m_tiles, wgs, 2) + table <= 227 * 1024


@pytest.mark.parametrize("family, args, smem, flagged", [
    ("gemm_latency", (4, "float16", "uint8", 1), 656, True),
    ("gemm_latency", (4, "float16", "uint8", 1), 640, False),
    ("gemm_mma", (4, "float16", "uint8", 1, 1, 0), 8240, True),   # mma.sync: the stage follows
    ("gemm_mma", (4, "float16", "uint8", 24, 1, 2), 1072, False),  # Hopper path: aligns itself
    ("quantize", (4, "float16", "uint8", False), 48, False),
])
def test_static_shared_memory_off_a_128_byte_line_fails_the_check(family, args, smem, flagged):
    """A launch whose dynamic stage follows its static shared memory fails the
    compile check where that static part is not a multiple of 128 bytes (16
    bytes more made gemm_latency's T = 1 launches up to 1.34x slower)."""
    st = {"registers": 100, "spill": 0, "stack": 0, "smem": smem}
    problems = _jit._variant_problems(_jit.Variant(family, args), st, "", "")
    assert any("static shared memory" in p for p in problems) == flagged, problems


@pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC and CUDA headers not installed")
def test_a_compile_without_a_ptxas_report_runs_again_uncached(monkeypatch):
    """Where NVRTC answers from a cache and ptxas does not run (NVRTC 13 with
    a GPU driver: the driver's compute cache), the check compiles those
    variants again in a process started with CUDA_CACHE_DISABLE=1 and reports
    what ptxas says, instead of failing with "no ptxas report"."""
    compile_once = _jit._nvrtc_compile
    asked = []

    def cached(source, names, options):  # what a cache hit returns: no ptxas lines
        ok, _, lowered = compile_once(source, names, options)
        asked.append(names)
        return ok, "", lowered

    monkeypatch.setattr(_jit, "_nvrtc_compile", cached)
    variants = [_jit.Variant("gemm_latency", (4, "float16", "uint8", 1)),
                _jit.Variant("dequantize", (3, "float16", "uint8"))]
    results = _jit.compile_check(["sm_90a"], variants, jobs=1)
    assert len(asked) == 2  # the first pass; the second ran in the child
    assert all(r.ok and r.registers > 0 and r.spill_bytes == 0 for r in results), results
