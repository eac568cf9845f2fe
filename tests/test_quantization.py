"""Quantized weights and KV cache: the int8 matmul against its float reference, each attention
backend over an 8-bit pool against the float reference, engines with int8 weights or an 8-bit
pool against a float engine, and GGUF files (Q8_0, Q4_K) served directly."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import SamplingParams
from jaxpaged.pallas_kernels import cpu_attention
from jaxpaged.pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from jaxpaged.pallas_kernels.quantized_matmul import (int8_matmul, int8_matmul_reference,
                                                      int8_dot_kernel, int8_dot_reference,
                                                      pack_int8, quantize_activations,
                                                      quantize_int8, unpack_rows, w8a8_matmul)
from jaxpaged.pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                            ragged_paged_attention_reference)
from jaxpaged.pallas_kernels.reference import (KV_CODE_DTYPES, dequantize_kv,
                                              paged_attention_xla_packed, quantize_kv)

needs_kernel = pytest.mark.skipif(not cpu_attention.available(), reason="no C++ compiler")


# -- int8 matmul -------------------------------------------------------------------------------

def test_quantize_int8_error_is_at_most_half_a_step():
    w = jax.random.normal(jax.random.key(0), (37, 70)) * jnp.arange(1, 38)[:, None]
    q, scale = quantize_int8(w)
    assert q.dtype == jnp.int8 and scale.shape == (37,)
    err = jnp.abs(q.astype(jnp.float32) * scale[:, None] - w)
    assert bool(jnp.all(err <= scale[:, None] / 2 + 1e-6))
    assert int(jnp.max(jnp.abs(q))) == 127  # each row's largest weight uses the full range


@needs_kernel
@pytest.mark.parametrize("M, N, K", [(1, 200, 576), (3, 37, 29), (4, 64, 16), (7, 130, 100),
                                     (33, 72, 1536)])
def test_int8_matmul_kernel_equals_dequantized_reference(M, N, K):
    kx, kw = jax.random.split(jax.random.key(M * N + K))
    x = jax.random.normal(kx, (M, K))
    q, scale = quantize_int8(jax.random.normal(kw, (N, K)))
    got = int8_matmul(x, q, scale, use_kernel=True)
    want = x @ (q.astype(jnp.float32) * scale[:, None]).T  # the dequantized float matmul
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(K))
    np.testing.assert_allclose(got, int8_matmul_reference(x, q, scale), rtol=1e-5,
                               atol=1e-5 * np.sqrt(K))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_int8_matmul_in_the_activation_dtype_sums_what_the_reference_sums(dtype):
    """The jnp path (GPU, TP) multiplies 16-bit activations by the int8 weights in their own
    dtype: every product is exact, so only the float32 summation order differs from the
    float32 reference's."""
    kx, kw = jax.random.split(jax.random.key(5))
    x = jax.random.normal(kx, (6, 384)).astype(dtype)
    q, scale = quantize_int8(jax.random.normal(kw, (96, 384)))
    got = int8_matmul(x, q, scale)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, int8_matmul_reference(x, q, scale), rtol=1e-5,
                               atol=1e-5 * np.sqrt(384) * float(jnp.abs(scale).max()))


def test_int8_matmul_names_bad_shapes():
    with pytest.raises(ValueError, match=r"w int8\[4, 3\]"):
        int8_matmul(jnp.ones((2, 5)), jnp.ones((4, 3), jnp.int8), jnp.ones((4,)))
    with pytest.raises(ValueError, match=r"w8a8_matmul: .* x float32\[2, 5\]"):
        w8a8_matmul(jnp.ones((2, 5)), jnp.ones((4, 3), jnp.int8), jnp.ones((4,)))


# -- W8A8 matmul -------------------------------------------------------------------------------

W8A8_SHAPES = [(1, 200, 576), (2, 37, 29), (3, 64, 1536), (4, 64, 16), (7, 130, 100),
               (33, 72, 1536), (64, 70, 30), (100, 576, 576), (257, 200, 96)]


# Jitted: one compilation per shape, where run eagerly each operation compiles for each shape.
quantize, pack, dot_reference = map(jax.jit, (quantize_int8, pack_int8, int8_dot_reference))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _w8a8_operands(M, N, K):
    kx, kw = jax.random.split(jax.random.key(M * N + K))
    x = jax.random.normal(kx, (M, K)) * jnp.linspace(0.1, 8, M)[:, None]
    x = x.at[0, 0].set(0.0 if M < 2 else x[0, 0])
    w, scale = quantize_int8(jax.random.normal(kw, (N, K)))
    return x, w, scale


@pytest.mark.parametrize("M, N, K", W8A8_SHAPES)
def test_int8_dot_is_the_exact_integer_sum_on_every_path(M, N, K):
    """The int8 product of quantized operands (XLA's int8 dot, and on CPU the kernel's VNNI and
    portable paths on the packed weights at any row count) equals their product summed exactly
    (int64 in NumPy)."""
    x, w, _ = _w8a8_operands(M, N, K)
    xq, _ = quantize(x)
    exact = np.asarray(xq, np.int64) @ np.asarray(w, np.int64).T
    assert np.abs(exact).max() < 2 ** 31
    np.testing.assert_array_equal(dot_reference(xq, w), exact)
    if cpu_attention.available():
        wp, wsum = pack(w)
        for portable in (False, True):
            np.testing.assert_array_equal(int8_dot_kernel(xq, wp, wsum, N, portable=portable),
                                          exact)


def test_packed_weights_hold_every_row():
    """`pack_int8`'s layout (N and K padded to 16 and 4) gives back each row in place
    (`unpack_rows`, the packed embedding's lookup), and `wsum` is each row's sum."""
    w = jax.random.randint(jax.random.key(1), (37, 30), -127, 128).astype(jnp.int8)
    wp, wsum = pack_int8(w)
    assert wp.shape == (3, 8, 16, 4) and wsum.shape == (48,)
    ids = jnp.array([[0, 36], [17, 16]])
    np.testing.assert_array_equal(unpack_rows(wp, ids, 30), np.asarray(w)[np.asarray(ids)])
    np.testing.assert_array_equal(wsum[:37], np.asarray(w, np.int64).sum(1))
    assert not np.any(np.asarray(wsum[37:]))


@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("M, N, K", W8A8_SHAPES)
def test_w8a8_matmul_equals_its_terms_and_the_float_product_within_the_bound(M, N, K, terms):
    """`w8a8_matmul` (activations as `terms` int8 terms per row) gives the same bits by XLA on
    weights i8[N, K] and by the C++ kernel on packed ones (its VNNI and portable paths); it
    equals the terms' exact integer products, scaled and added in order, up to float32
    rounding (XLA fuses a scaling and the sum into one FMA, as the kernel does); and it is
    within the activations' quantization bound of the float product with the int8 weights."""
    x, w, scale = _w8a8_operands(M, N, K)
    got = np.asarray(w8a8_matmul(x, w, scale, terms=terms))
    if cpu_attention.available():
        wp, wsum = pack(w)
        for portable in (False, True):
            np.testing.assert_array_equal(
                w8a8_matmul(x, wp, scale, wsum, terms=terms, portable=portable), got)
    xq, sx = jax.jit(quantize_activations, static_argnums=1)(x, terms)  # as w8a8_matmul does
    exact = np.asarray(xq, np.int64) @ np.asarray(w, np.int64).T
    parts = exact.astype(np.float32) * (np.asarray(sx)[:, None] * np.asarray(scale)[None, :])
    want = parts[:M] if terms == 1 else parts[:M] + parts[M:]
    size = np.abs(parts[:M]) + (0 if terms == 1 else np.abs(parts[M:]))
    w_float = np.asarray(w, np.float32) * np.asarray(scale)[:, None]
    ref = np.asarray(x, np.float64) @ w_float.T.astype(np.float64)
    # The terms leave at most s_last / 2 per element, so each output is off by at most
    # s_last / 2 * sum_k |w_float[n, k]| (plus float32 rounding).
    bound = np.asarray(sx)[-M:, None] / 2 * np.abs(w_float).sum(1)[None, :]
    assert np.all(np.abs(got - want) <= 2.0 ** -22 * size)  # two float32 roundings
    assert np.all(np.abs(got - ref) <= bound * (1 + 1e-4) + 1e-5 * np.abs(ref) + 1e-6)
    if terms == 2:  # the second term's scale is at most 1/254 of the first's
        assert np.all(np.asarray(sx)[M:] <= np.asarray(sx)[:M] / 254 * (1 + 1e-6) + 1e-30)


@needs_kernel
def test_w8a8_kernel_quantizes_many_rows_as_xla_does():
    """Over 40,000 rows with outlier features, the kernel's quantization and scaling give
    XLA's bits in every row (a rounding that differs in one element of one row would show)."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((20000, 96)) * np.exp(rng.standard_normal(96) * 2),
                    jnp.float32)
    w = jnp.asarray(rng.integers(-127, 128, (48, 96)), jnp.int8)
    scale = jnp.asarray(rng.random(48) * 0.01, jnp.float32)
    wp, wsum = pack_int8(w)
    for x_ in (x, x * 1e-3):
        np.testing.assert_array_equal(w8a8_matmul(x_, wp, scale, wsum), w8a8_matmul(x_, w, scale))


@needs_kernel
def test_w8a8_kernel_names_a_term_count_it_does_not_take():
    x, w, scale = _w8a8_operands(3, 40, 64)
    wp, wsum = pack_int8(w)
    with pytest.raises(ValueError, match="terms must be 1 or 2, got 3"):
        w8a8_matmul(x, wp, scale, wsum, terms=3)


def test_w8a8_rows_do_not_depend_on_the_rest_of_the_step():
    """A row's output is the same alone, in a step the kernel takes and in XLA's."""
    x, w, scale = _w8a8_operands(70, 130, 200)
    weights = [(w, None)] + ([pack_int8(w)] if cpu_attention.available() else [])
    for w_, wsum in weights:
        full = np.asarray(w8a8_matmul(x, w_, scale, wsum))
        for rows in ([5], [5, 6], [0, 5, 69], list(range(20))):
            np.testing.assert_array_equal(w8a8_matmul(x[jnp.array(rows)], w_, scale, wsum),
                                          full[rows])


@needs_kernel
def test_w8a8_kernel_builds_for_a_cpu_without_avx512(tmp_path):
    """The W8A8 and Q8_0 kernel sources compile for x86-64-v3 (AVX2, no AVX-512, no VNNI) and
    for the machine's own flags: the VNNI code is compiled by function attribute and chosen at
    run time (`__builtin_cpu_supports`), so a CPU without it runs the portable path, whose
    results the tests above compare."""
    import platform
    import shutil
    import subprocess

    if platform.machine() != "x86_64" or shutil.which("c++") is None:
        pytest.skip("x86-64 with a C++ compiler only")
    for src in cpu_attention._SOURCES:
        if src.name not in ("w8a8_matmul_cpu.cc", "q8_0_matmul_cpu.cc"):
            continue
        proc = subprocess.run(["c++", "-O2", "-march=x86-64-v3", "-std=c++17", "-c", "-fPIC",
                               f"-I{jax.ffi.include_dir()}", str(src), "-o",
                               str(tmp_path / "k.o")], capture_output=True, text=True)
        assert proc.returncode == 0, (src.name, proc.stderr[-2000:])
    assert cpu_attention.w8a8_isa() in ("avx512-vnni", "portable")


# -- attention over an 8-bit pool --------------------------------------------------------------

def _pool(key, K=2, P=12, S=16, H=64):
    kk, kv = jax.random.split(key)
    return jax.random.normal(kk, (K, P, S, H)), jax.random.normal(kv, (K, P, S, H))


def _quantized(pages, kind):
    codes, scales = quantize_kv(pages, KV_CODE_DTYPES[kind][0])
    return codes, scales, dequantize_kv(codes, scales)


# Relative error of an 8-bit value against float: int8 half a step of max|x| / 127 per element;
# float8_e4m3fn's 3 mantissa bits, about 6%. Attention outputs average many values.
QUANT_TOL = {"int8": 0.02, "fp8": 0.1}


# The references jitted: one compilation per shape, where run eagerly each of their operations
# compiles for each shape.
paged_reference = jax.jit(paged_attention_reference, static_argnames="scale")
ragged_reference = jax.jit(ragged_paged_attention_reference, static_argnames="scale")


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("backend", ["xla", "cpu", "pallas-decode", "pallas-ragged"])
def test_attention_backends_read_the_8bit_pool(kind, backend):
    """Each backend over the 8-bit pool equals its float reference over the decoded pool (up to
    float rounding), and the float pool's result within the quantization error."""
    if backend == "cpu" and not cpu_attention.available():
        pytest.skip("no C++ compiler")
    k_pages, v_pages = _pool(jax.random.key(1))
    K, P, S, H = k_pages.shape
    N = 4
    kc, ks, k_deq = _quantized(k_pages, kind)
    vc, vs, v_deq = _quantized(v_pages, kind)
    block_tables = jnp.array([[3, 7, 1, 0], [5, 2, 9, 11]], jnp.int32)
    seq_lens = jnp.array([45, 60], jnp.int32)
    scale = H ** -0.5
    if backend == "pallas-decode":
        q = jax.random.normal(jax.random.key(2), (2, N, H))
        run = functools.partial(paged_attention, q, block_tables=block_tables,
                                context_lens=seq_lens, scale=scale, interpret=True)
        got = run(kc, vc, k_scales=ks, v_scales=vs)
        ref = lambda kp, vp: paged_reference(q, kp, vp, block_tables, seq_lens, scale=scale)
    else:
        q_lens = (3, 1)  # a prompt chunk and a decode
        cu = jnp.array([0, 3, 4], jnp.int32)
        q = jax.random.normal(jax.random.key(2), (5, N, H))  # one padding token
        if backend == "pallas-ragged":
            got = ragged_paged_attention(q, kc, vc, block_tables, seq_lens, cu, 2, scale=scale,
                                         interpret=True, k_scales=ks, v_scales=vs)[:4]
        elif backend == "xla":
            got = paged_attention_xla_packed(q, kc, vc, block_tables, seq_lens, cu, scale=scale,
                                             k_scales=ks, v_scales=vs)[:4]
        else:  # the C++ kernel: cached blocks in a flat list, new tokens as arguments
            got = _cpu_attention(q, kc, vc, ks, vs, k_deq, v_deq, block_tables, seq_lens,
                                 q_lens, kind, scale)
        ref = lambda kp, vp: ragged_reference(q, kp, vp, block_tables, seq_lens, cu, 2,
                                              scale=scale)[:4]
    np.testing.assert_allclose(got, ref(k_deq, v_deq), rtol=2e-5, atol=2e-5)
    exact = ref(k_pages, v_pages)
    err = float(jnp.max(jnp.abs(got - exact)) / jnp.max(jnp.abs(exact)))
    assert 0 < err < QUANT_TOL[kind], err


def _cpu_attention(q, kc, vc, ks, vs, k_deq, v_deq, block_tables, seq_lens, q_lens, kind,
                   scale):
    """The C++ kernel on the 8-bit pool [1, 2, K, P, S, H]; the new tokens' K/V are the
    decoded pool's (the float values that would have been written)."""
    from jaxpaged.pallas_kernels.reference import QuantizedKVCache

    K, P, S, H = kc.shape
    blocks, rows, lens, k_new, v_new = [], [], [], [], []
    for b, (n_new, n) in enumerate(zip(q_lens, np.asarray(seq_lens))):
        c = int(n) - n_new
        for j in range(-(-c // S)):
            blocks.append(int(block_tables[b, j]))
            rows.append(b)
            lens.append(min(S, c - j * S))
        pos = np.arange(c, int(n))
        table = np.asarray(block_tables[b])
        k_new.append(k_deq[:, table[pos // S], pos % S].transpose(1, 0, 2))
        v_new.append(v_deq[:, table[pos // S], pos % S].transpose(1, 0, 2))
    k_new = jnp.concatenate(k_new + [jnp.zeros((1, K, H))])
    v_new = jnp.concatenate(v_new + [jnp.zeros((1, K, H))])
    cache = QuantizedKVCache(jnp.stack([kc, vc])[None], jnp.stack([ks, vs])[None])
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    out, _ = cpu_attention.paged_attention_cpu(
        q, k_new, v_new, cache, 0, i32([0, q_lens[0], sum(q_lens)]), i32(q_lens), i32(blocks),
        i32(rows), i32(lens), scale=scale)
    return out[:4]


def test_8bit_pallas_kernels_lower_for_cuda():
    from jax import export

    K, P, S, H, B, M, T, N = 3, 64, 16, 64, 8, 16, 64, 9
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    for storage in (jnp.int8, jnp.uint8):
        pages = jax.ShapeDtypeStruct((K, P, S, H), storage)
        for kernel, args in [
                (functools.partial(paged_attention, scale=0.125),
                 (f32(B, N, H), pages, pages, i32(B, M), i32(B), f32(K, P, S), f32(K, P, S))),
                (functools.partial(ragged_paged_attention, scale=0.125),
                 (f32(T, N, H), pages, pages, i32(B, M), i32(B), i32(B + 1), i32(),
                  f32(K, P, S), f32(K, P, S)))]:
            n = len(args) - 2
            fn = lambda *a, kernel=kernel, n=n: kernel(*a[:n], k_scales=a[n], v_scales=a[n + 1])
            exported = export.export(
                jax.jit(fn), platforms=["cuda"],
                disabled_checks=[export.DisabledSafetyCheck.custom_call(
                    "__gpu$xla.gpu.triton")])(*args)
            assert "__gpu$xla.gpu.triton" in exported.mlir_module()


# -- engines -----------------------------------------------------------------------------------

PROMPTS = ["The capital of France is", "def add(a, b):", "1, 2, 3, 4,"]


def _confident_prefix(output, margin: float) -> int:
    """Tokens of a float engine's greedy output before the first whose top-2 logprob margin is
    under `margin` (there a quantized model may fairly pick the other token)."""
    for i, entry in enumerate(output.logprobs):
        top = sorted((lp.logprob for lp in entry.values()), reverse=True)
        if len(top) < 2 or top[0] - top[1] < margin:
            return i
    return len(output.token_ids)


@pytest.fixture(scope="module")
def float_outputs(tiny_model_dir):
    from jaxpaged import LLM

    llm = LLM(tiny_model_dir, max_model_len=256, num_kv_blocks=64, precompile=False,
              compilation_cache_dir=None)
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, logprobs=2),
                       use_tqdm=False)
    return [o.outputs[0] for o in out]


@pytest.mark.parametrize("options", [dict(quantization="int8"), dict(quantization="w8a8"),
                                     dict(quantization="q8_0"),
                                     dict(kv_cache_dtype="int8"), dict(kv_cache_dtype="fp8"),
                                     dict(kv_cache_dtype="int8", attention_backend="xla")],
                         ids=["w-int8", "w8a8", "q8_0", "kv-int8", "kv-fp8", "kv-int8-xla"])
def test_quantized_engine_greedy_ids_match_float_where_margins_are_large(
        make_llm, tiny_model_dir, float_outputs, options):
    llm = make_llm(tiny_model_dir, max_num_seqs=4, compilation_cache_dir=None, **options)
    params = SamplingParams(temperature=0, max_tokens=12)
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert first == again  # deterministic run to run
    checked = 0
    for ref, ids in zip(float_outputs, first):
        n = _confident_prefix(ref, margin=0.1)
        assert list(ids[:n]) == list(ref.token_ids[:n]), (options, ids, ref.token_ids)
        checked += n
    assert checked >= 6, "the float model's margins left too few tokens to compare"
    if options.get("quantization") == "w8a8":  # packed for the C++ GEMM where it has VNNI
        packed = cpu_attention.available() and cpu_attention.w8a8_isa() == "avx512-vnni"
        assert down_proj(llm).weight.ndim == (4 if packed else 2)
    stats = llm.stats()
    if "quantization" in options:
        assert stats["weight_bytes"] < 0.3 * _float_bytes(tiny_model_dir)
    else:  # L * 2 * K * (H one-byte codes + a float32 scale), float32's being L * 2 * K * H * 4
        assert stats["kv_cache_bytes_per_token"] == 2 * 2 * 2 * (16 + 4)


def _float_bytes(model_dir) -> int:
    from safetensors import safe_open

    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, "numpy") as f:
            total += sum(int(np.prod(f.get_slice(k).get_shape())) * 4 for k in f.keys())
    return total


def test_bad_quantization_options_are_named(tiny_model_dir):
    from jaxpaged import LLM

    with pytest.raises(ValueError, match="'int3'"):
        LLM(tiny_model_dir, quantization="int3", precompile=False)
    with pytest.raises(ValueError, match="'int4'"):
        LLM(tiny_model_dir, kv_cache_dtype="int4", precompile=False)


# -- GGUF served directly ----------------------------------------------------------------------

def write_quantized_gguf(path, qtype: str):
    """A tiny random Llama (hidden and intermediate 256) written to `path` as llama.cpp does,
    every linear layer in `qtype` (a `gguf.GGMLQuantizationType` name), the embedding float."""
    import torch
    from gguf import GGMLQuantizationType as Q
    from transformers import AutoConfig, AutoModelForCausalLM

    from test_gguf_import import CASES, SHAPE, write_gguf

    model_type, fields, tokenizer, _ = CASES["llama"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        model_type, **{**SHAPE, **fields, "intermediate_size": 256, "hidden_size": 256}))
    quant = {name: getattr(Q, qtype) for name, p in model.state_dict().items()
             if p.ndim == 2 and "embed" not in name}
    write_gguf(path, "llama", model, tokenizer=tokenizer, quant=quant)


def assert_greedy_ids_match_where_margins_are_large(reference, llm) -> None:
    """`llm`'s greedy ids equal `reference`'s on two prompts up to the first token whose
    top-2 logprob margin under `reference` is under 0.1."""
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    ref = [o.outputs[0] for o in reference.generate(["ab", "hello"], params, use_tqdm=False)]
    got = [o.outputs[0] for o in llm.generate(["ab", "hello"], params, use_tqdm=False)]
    for r, g in zip(ref, got):
        n = _confident_prefix(r, margin=0.1)
        assert list(g.token_ids[:n]) == list(r.token_ids[:n])


def down_proj(llm, layer: int = 0):
    """The engine's down projection of `layer`, as a module (`QuantizedLinear` when
    quantized)."""
    from flax import nnx

    runner = llm.llm_engine.runner
    return nnx.merge(runner.graphdef, runner.params).layers[layer].mlp.down_proj


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_gguf_file_runs_directly(make_llm, tmp_path, monkeypatch, qtype):
    """A GGUF whose linear layers are all Q8_0 (or Q4_K) serves from the file (W8A8,
    no safetensors written) with the greedy ids of an engine on its imported float32 folder
    where margins are large."""
    from jaxpaged.model_loader.gguf_import import import_gguf

    monkeypatch.setenv("JAXPAGED_HOME", str(tmp_path / "home"))
    path = tmp_path / "model.gguf"
    write_quantized_gguf(path, qtype)
    imported = tmp_path / "imported"
    import_gguf(path, imported, progress=False)

    direct = make_llm(str(path), compilation_cache_dir=None)
    assert direct.llm_engine.quantization == "w8a8"  # the default for a GGUF file
    assert not list((tmp_path / "home").rglob("*.safetensors"))
    floats = make_llm(imported, compilation_cache_dir=None)
    assert_greedy_ids_match_where_margins_are_large(floats, direct)
    assert direct.stats()["weight_bytes"] < 0.3 * floats.stats()["weight_bytes"]


@needs_kernel
@pytest.mark.parametrize("options", [dict(kv_cache_dtype="int8", attention_backend="cpu"),
                                     dict(quantization="w8a8"), dict(quantization="q8_0")],
                         ids=["kv-int8", "w8a8", "q8_0"])
def test_8bit_modes_keep_batch_invariance(make_llm, head64_model_dir, options):
    """Batch-invariant results stay bitwise the same alone, together and chunked (the tiny
    Llama with 64-feature heads, as `test_batch_invariance` runs the kernel): with an 8-bit
    pool the C++ kernel attends to a step's own tokens as the pool holds them; with W8A8
    weights every step is W8A8, whose integer sums do not mix a step's rows; with Q8_0 every
    step takes the Q8_0 kernel, which computes each row alone."""
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 20000, n).tolist()} for n in (9, 40, 23)]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)

    def run(llm, rows):
        outs = llm.generate([prompts[i] for i in rows], params, use_tqdm=False)
        return {i: (o.outputs[0].token_ids,
                    [sorted((t, lp.logprob) for t, lp in e.items()) for e in o.outputs[0].logprobs])
                for i, o in zip(rows, outs)}

    kw = dict(batch_invariant=True, enable_prefix_caching=False, compilation_cache_dir=None,
              **options)
    llm = make_llm(head64_model_dir, **kw)
    alone = {}
    for i in range(3):
        alone.update(run(llm, [i]))
    assert run(llm, [0, 1, 2]) == alone
    chunked = make_llm(head64_model_dir, max_num_batched_tokens=16,
                       long_prefill_token_threshold=8, **kw)
    assert run(chunked, [0, 1, 2]) == alone
