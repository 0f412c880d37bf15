// pdserve's fused CPU kernels for the float32 decoder step (engine/cpu_ops.py builds and loads
// this file; engine/cpu_ops.py's TorchOps is the reference each kernel is tested against).
//
// Why: at batch 1 a SmolLM2 step runs ~40 small ATen ops per layer besides its four matrix
// products; each costs 1-25 us of dispatch, TensorIterator set-up and (for reductions) several
// passes, ~4.5 ms of a ~20 ms step. These kernels do one pass each:
//   add_rms_norm     residual add + RMSNorm (HF LlamaRMSNorm: w * x * rsqrt(mean(x^2) + eps))
//   rope_store_kv    RoPE on q and k (HF rotate_half layout) in place + K/V write into the paged cache
//   decode_attention one query token per sequence against its paged K/V (GQA, sliding windows)
//   silu_mul         SwiGLU's silu(gate) * up
// All float32, row-major, CPU; checked shapes raise c10::Error (RuntimeError in Python).
// Parallel regions use ATen's thread pool (at::parallel_for), never a second OpenMP runtime.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kGrain = 32768;  // elements below which a loop stays on the calling thread

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
}

// exp(x) in float32 within ~2 ulp (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6
// polynomial in r, times 2^n), written so that `omp simd` loops vectorize it (std::exp does not
// without -ffast-math). x is clamped to [-87.3, 88.7]: exp(-inf) -> ~1e-38, not 0.
inline float exp_f32(float x) {
  x = std::min(88.7f, std::max(-87.3f, x));
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  return y * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// x [T, H] (contiguous, updated in place: x += delta when delta is defined); returns the
// RMSNorm of the (updated) x scaled by w [H].
at::Tensor add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& delta, const at::Tensor& w,
                        double eps) {
  check_f32(x, "x");
  check_f32(w, "w");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, H] tensor");
  const int64_t t = x.size(0), h = x.size(1);
  TORCH_CHECK(w.numel() == h && w.is_contiguous(), "w must be [H]");
  at::Tensor d;
  if (delta.has_value()) {
    d = delta->contiguous();
    check_f32(d, "delta");
    TORCH_CHECK(d.sizes() == x.sizes(), "delta must have x's shape");
  }
  at::Tensor out = at::empty_like(x);
  float* xp = x.data_ptr<float>();
  const float* dp = d.defined() ? d.data_ptr<float>() : nullptr;
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, t, std::max<int64_t>(1, kGrain / h), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* xr = xp + r * h;
      if (dp) {
        const float* dr = dp + r * h;
#pragma omp simd
        for (int64_t i = 0; i < h; ++i) xr[i] += dr[i];
      }
      const float inv = 1.f / std::sqrt(dot(xr, xr, h) / static_cast<float>(h) + feps);
      float* o = op + r * h;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) o[i] = wp[i] * (xr[i] * inv);
    }
  });
  return out;
}

// qkv [T, nh + 2 * kvh, hd] (contiguous; q heads, then k heads, then v heads): RoPE on the first
// nh + kvh heads in place with cos/signed-sin table rows [P, hd] at positions [T]; then k and v
// of token i are written to kv_cache[slot_blocks[i], layer, 0/1, slot_offsets[i]]
// (kv_cache [N, L, 2, bs, kvh, hd], contiguous).
void rope_store_kv(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& positions, at::Tensor kv_cache, int64_t layer,
                   const at::Tensor& slot_blocks, const at::Tensor& slot_offsets, int64_t num_heads) {
  check_f32(qkv, "qkv");
  check_f32(kv_cache, "kv_cache");
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous(), "qkv must be a contiguous [T, heads, hd] tensor");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous(), "kv_cache must be a contiguous 6-D cache");
  const int64_t t = qkv.size(0), hd = qkv.size(2), kvh = kv_cache.size(4), bs = kv_cache.size(3);
  const int64_t nblocks = kv_cache.size(0), nlayers = kv_cache.size(1);
  TORCH_CHECK(qkv.size(1) == num_heads + 2 * kvh && kv_cache.size(5) == hd, "qkv and kv_cache disagree");
  TORCH_CHECK(hd % 2 == 0 && layer >= 0 && layer < nlayers, "bad head_dim or layer");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == hd && sin.sizes() == cos.sizes(),
              "cos/sin must be contiguous [P, hd]");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  auto pos = positions.to(at::kLong).contiguous();
  auto blk = slot_blocks.to(at::kLong).contiguous();
  auto off = slot_offsets.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == t && blk.numel() == t && off.numel() == t, "one position and slot per token");
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* bp = blk.data_ptr<int64_t>();
  const int64_t* ofp = off.data_ptr<int64_t>();
  const int64_t heads = num_heads + 2 * kvh, half = hd / 2, p_max = cos.size(0);
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(pp[i] >= 0 && pp[i] < p_max, "position ", pp[i], " outside the RoPE table");
    TORCH_CHECK(bp[i] >= 0 && bp[i] < nblocks && ofp[i] >= 0 && ofp[i] < bs, "slot outside the cache");
  }
  float* qp = qkv.data_ptr<float>();
  float* cp = kv_cache.data_ptr<float>();
  const float* ct = cos.data_ptr<float>();
  const float* st = sin.data_ptr<float>();
  const int64_t row = bs * kvh * hd;  // one block's K (or V) of one layer
  at::parallel_for(0, t, std::max<int64_t>(1, kGrain / (heads * hd)), [&](int64_t b, int64_t e) {
    std::vector<float> tmp(hd);
    for (int64_t i = b; i < e; ++i) {
      const float* c = ct + pp[i] * hd;
      const float* s = st + pp[i] * hd;
      float* tok = qp + i * heads * hd;
      for (int64_t h = 0; h < num_heads + kvh; ++h) {
        float* x = tok + h * hd;
        std::copy(x, x + hd, tmp.data());
        // x * cos + roll(x, half) * signed_sin (engine.layers.apply_rope)
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) x[d] = tmp[d] * c[d] + tmp[d + half] * s[d];
#pragma omp simd
        for (int64_t d = half; d < hd; ++d) x[d] = tmp[d] * c[d] + tmp[d - half] * s[d];
      }
      float* kdst = cp + ((bp[i] * nlayers + layer) * 2) * row + ofp[i] * kvh * hd;
      std::copy(tok + num_heads * hd, tok + (num_heads + kvh) * hd, kdst);
      std::copy(tok + (num_heads + kvh) * hd, tok + heads * hd, kdst + row);
    }
  });
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
constexpr bool kAvx2 = true;

// [sum(v[0]), ..., sum(v[7])] in one vector (two hadd levels and a lane swap).
inline __m256 hsum8x8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// scores[j] = q . keys[j] * scale for 8 keys (hd % 8 == 0).
inline void qk8(const float* q, const float* const* keys, int64_t hd, float scale, float* scores) {
  __m256 acc[8];
  for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_ps();
  for (int64_t d = 0; d < hd; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int k = 0; k < 8; ++k) acc[k] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[k] + d), acc[k]);
  }
  _mm256_storeu_ps(scores, _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale)));
}

// o[0:64] = sum_j p[j] * vals[j][0:64] with the 64 outputs in registers.
inline void pv64(const float* p, const float* const* vals, int64_t n, int64_t d0, float* o) {
  __m256 acc[8];
  for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const float* v = vals[j] + d0;
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * c), acc[c]);
  }
  for (int c = 0; c < 8; ++c) _mm256_storeu_ps(o + d0 + 8 * c, acc[c]);
}
#else
constexpr bool kAvx2 = false;
#endif

// One (sequence, KV head) of decode_attention: the `group` query heads q[a] (stride qs) against
// the n keys/values at kptr/vptr; writes out[a] (stride hd).
void attend_kv_head(const float* q, int64_t qs, int64_t group, const float* const* kptr,
                    const float* const* vptr, int64_t n, int64_t hd, float scale, float* out,
                    std::vector<float>& score) {
  score.resize(n);
  for (int64_t a = 0; a < group; ++a) {
    const float* qa = q + a * qs;
    float* sc = score.data();
    int64_t j = 0;
    if (kAvx2 && hd % 8 == 0) {
#if defined(__AVX2__) && defined(__FMA__)
      for (; j + 8 <= n; j += 8) qk8(qa, kptr + j, hd, scale, sc + j);
#endif
    }
    for (; j < n; ++j) sc[j] = dot(qa, kptr[j], hd) * scale;
    const float mx = *std::max_element(sc, sc + n);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) { sc[i] = exp_f32(sc[i] - mx); sum += sc[i]; }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) sc[i] *= inv;
    float* o = out + a * hd;
    int64_t d0 = 0;
    if (kAvx2) {
#if defined(__AVX2__) && defined(__FMA__)
      for (; d0 + 64 <= hd; d0 += 64) pv64(sc, vptr, n, d0, o);
#endif
    }
    if (d0 < hd) {
      std::fill(o + d0, o + hd, 0.f);
      for (int64_t i = 0; i < n; ++i) {
        const float* v = vptr[i];
#pragma omp simd
        for (int64_t c = d0; c < hd; ++c) o[c] += sc[i] * v[c];
      }
    }
  }
}

// q [D, nh, hd] (rows may be strided: a view of qkv); tables [D, nb] block ids; key_ranges
// [D, 2]: row r attends to keys [lo, hi) of its table (key j = token j % bs of block j / bs).
// Returns softmax(q k^T * scale) v per query head, [D, nh, hd]; query head h reads KV head
// h / (nh / kvh) (HF repeat_kv). Softmax in float32 with the row max subtracted (SDPA's).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, int64_t layer,
                            const at::Tensor& tables, const at::Tensor& key_ranges, double scale) {
  check_f32(q, "q");
  check_f32(kv_cache, "kv_cache");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [D, heads, hd] with contiguous heads");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous(), "kv_cache must be a contiguous 6-D cache");
  const int64_t d = q.size(0), nh = q.size(1), hd = q.size(2);
  const int64_t nblocks = kv_cache.size(0), nlayers = kv_cache.size(1), bs = kv_cache.size(3);
  const int64_t kvh = kv_cache.size(4);
  TORCH_CHECK(kv_cache.size(5) == hd && nh % kvh == 0, "q and kv_cache disagree");
  TORCH_CHECK(layer >= 0 && layer < nlayers, "bad layer");
  auto tab = tables.to(at::kLong).contiguous();
  auto rng = key_ranges.to(at::kLong).contiguous();
  TORCH_CHECK(tab.dim() == 2 && tab.size(0) == d && rng.dim() == 2 && rng.size(0) == d && rng.size(1) == 2,
              "tables [D, nb] and key_ranges [D, 2]");
  const int64_t nb = tab.size(1);
  const int64_t* tp = tab.data_ptr<int64_t>();
  const int64_t* rp = rng.data_ptr<int64_t>();
  int64_t keys = 0;
  for (int64_t r = 0; r < d; ++r) {
    TORCH_CHECK(0 <= rp[2 * r] && rp[2 * r] < rp[2 * r + 1] && rp[2 * r + 1] <= nb * bs, "bad key range");
    for (int64_t j = rp[2 * r] / bs; j < (rp[2 * r + 1] + bs - 1) / bs; ++j)
      TORCH_CHECK(0 <= tp[r * nb + j] && tp[r * nb + j] < nblocks, "block id outside the cache");
    keys += rp[2 * r + 1] - rp[2 * r];
  }
  at::Tensor out = at::empty({d, nh, hd}, q.options());
  const float* qp = q.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const float* cp = kv_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = nh / kvh, row = bs * kvh * hd;
  const float fscale = static_cast<float>(scale);
  // about kGrain multiply-adds of work per task
  const int64_t grain = std::max<int64_t>(1, (kGrain * d * kvh) / std::max<int64_t>(1, 2 * keys * hd * group));
  at::parallel_for(0, d * kvh, grain, [&](int64_t b, int64_t e) {
    std::vector<float> score;
    std::vector<const float*> kptr, vptr;
    for (int64_t u = b; u < e; ++u) {
      const int64_t r = u / kvh, g = u % kvh, lo = rp[2 * r], hi = rp[2 * r + 1];
      kptr.resize(hi - lo);
      vptr.resize(hi - lo);
      for (int64_t j = lo, blk = lo / bs, off = lo % bs; j < hi; ++j) {  // no division per key
        const float* k = cp + ((tp[r * nb + blk] * nlayers + layer) * 2) * row + (off * kvh + g) * hd;
        kptr[j - lo] = k;
        vptr[j - lo] = k + row;
        if (++off == bs) off = 0, ++blk;
      }
      attend_kv_head(qp + r * qs0 + g * group * qs1, qs1, group, kptr.data(), vptr.data(), hi - lo, hd,
                     fscale, op + (r * nh + g * group) * hd, score);
    }
  });
  return out;
}

// y[n] = w[n, :] . x for rows [n0, n1) of a dense row-major w [N, K]: four weight rows stream at
// once (x stays in L1), two accumulators per row.
void gemv_rows(const float* x, const float* w, float* y, int64_t k, int64_t n0, int64_t n1) {
  int64_t n = n0;
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t k16 = k - k % 16;
  for (; n + 4 <= n1; n += 4) {
    const float* r[4] = {w + n * k, w + (n + 1) * k, w + (n + 2) * k, w + (n + 3) * k};
    __m256 a[4], b[4];
    for (int i = 0; i < 4; ++i) a[i] = b[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < k16; c += 16) {
      const __m256 x0 = _mm256_loadu_ps(x + c), x1 = _mm256_loadu_ps(x + c + 8);
      for (int i = 0; i < 4; ++i) {
        a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(r[i] + c), x0, a[i]);
        b[i] = _mm256_fmadd_ps(_mm256_loadu_ps(r[i] + c + 8), x1, b[i]);
      }
    }
    for (int i = 0; i < 4; ++i) {
      const __m256 s = _mm256_add_ps(a[i], b[i]);
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      h = _mm_add_ss(h, _mm_movehdup_ps(h));
      float acc = _mm_cvtss_f32(h);
      for (int64_t c = k16; c < k; ++c) acc += r[i][c] * x[c];
      y[n + i] = acc;
    }
  }
#endif
  for (; n < n1; ++n) y[n] = dot(w + n * k, x, k);
}

#if defined(__x86_64__)
// gemv_rows with 512-bit vectors, for CPUs with AVX-512 (chosen at run time: the library is
// built for x86-64-v3).
__attribute__((target("avx512f"))) void gemv_rows_avx512(const float* x, const float* w, float* y, int64_t k,
                                                          int64_t n0, int64_t n1) {
  int64_t n = n0;
  const int64_t k32 = k - k % 32;
  for (; n + 4 <= n1; n += 4) {
    const float* r[4] = {w + n * k, w + (n + 1) * k, w + (n + 2) * k, w + (n + 3) * k};
    __m512 a[4], b[4];
    for (int i = 0; i < 4; ++i) a[i] = b[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < k32; c += 32) {
      const __m512 x0 = _mm512_loadu_ps(x + c), x1 = _mm512_loadu_ps(x + c + 16);
      for (int i = 0; i < 4; ++i) {
        a[i] = _mm512_fmadd_ps(_mm512_loadu_ps(r[i] + c), x0, a[i]);
        b[i] = _mm512_fmadd_ps(_mm512_loadu_ps(r[i] + c + 16), x1, b[i]);
      }
    }
    for (int i = 0; i < 4; ++i) {
      float acc = _mm512_reduce_add_ps(_mm512_add_ps(a[i], b[i]));
      for (int64_t c = k32; c < k; ++c) acc += r[i][c] * x[c];
      y[n + i] = acc;
    }
  }
  for (; n < n1; ++n) y[n] = dot(w + n * k, x, k);
}
bool has_avx512() {
  static const bool yes = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f"));
  return yes;
}
#else
bool has_avx512() { return false; }
void gemv_rows_avx512(const float*, const float*, float*, int64_t, int64_t, int64_t) {}
#endif

// x [1, K] @ w [N, K]^T (+ bias [N]) -> [1, N] for a dense float32 w: the batch-1 product of a
// decode step, read at close to the memory bandwidth (each thread streams one contiguous share
// of the rows). engine.cpu_linear uses it for one-row inputs; more rows go to oneDNN.
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  check_f32(x, "x");
  check_f32(w, "w");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && w.dim() == 2 && w.size(1) == x.size(1) && w.is_contiguous(),
              "gemv takes x [1, K] and a contiguous w [N, K]");
  const int64_t n = w.size(0), k = w.size(1);
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({1, n}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (n * k) / kGrain));
  const int64_t share = ((n + nt - 1) / nt + 3) / 4 * 4;  // rows per thread, a multiple of 4
  at::parallel_for(0, nt, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t n0 = std::min(n, t * share), n1 = std::min(n, (t + 1) * share);
      has_avx512() ? gemv_rows_avx512(xp, wp, yp, k, n0, n1) : gemv_rows(xp, wp, yp, k, n0, n1);
    }
  });
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "bias must be [N]");
    y.add_(*bias);
  }
  return y;
}

// gate_up [T, 2I] (gate then up) -> silu(gate) * up [T, I].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_f32(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous [T, 2I] tensor");
  const int64_t t = gate_up.size(0), i2 = gate_up.size(1), n = i2 / 2;
  at::Tensor out = at::empty({t, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, t, std::max<int64_t>(1, kGrain / i2), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* g = gp + r * i2;
      const float* u = g + n;
      float* o = op + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + exp_f32(-g[i])) * u[i];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def("add_rms_norm(Tensor(a!) x, Tensor? delta, Tensor w, float eps) -> Tensor");
  m.def("rope_store_kv(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor positions, Tensor(b!) kv_cache, "
        "int layer, Tensor slot_blocks, Tensor slot_offsets, int num_heads) -> ()");
  m.def("decode_attention(Tensor q, Tensor kv_cache, int layer, Tensor tables, Tensor key_ranges, "
        "float scale) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gemv(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("rope_store_kv", rope_store_kv);
  m.impl("decode_attention", decode_attention);
  m.impl("silu_mul", silu_mul);
  m.impl("gemv", gemv);
}
