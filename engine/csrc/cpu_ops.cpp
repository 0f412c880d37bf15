// pdserve's fused CPU kernels for the float32 and bfloat16 decoder step (engine/cpu_ops.py builds and loads
// this file; engine/cpu_ops.py's TorchOps is the reference each kernel is tested against).
//
// Why: at batch 1 a SmolLM2 step runs ~40 small ATen ops per layer besides its four matrix
// products; each costs 1-25 us of dispatch, TensorIterator set-up and (for reductions) several
// passes, ~4.5 ms of a ~20 ms step. These kernels do one pass each:
//   add_rms_norm     residual add + RMSNorm (HF LlamaRMSNorm: w * x * rsqrt(mean(x^2) + eps))
//   rope_store_kv    RoPE on q and k (HF rotate_half layout) in place + K/V write into the paged cache
//   decode_attention one query token per sequence against its paged K/V (GQA, sliding windows)
//   silu_mul         SwiGLU's silu(gate) * up
//   gemv             one-row linear product streamed at close to the memory bandwidth
//   argmax_rows      greedy sampling's argmax over each logits row (torch.argmax's answer)
//   decode_layers    every decoder layer of a batch-1 decode step in one call: the kernels above
//                    (their same inner loops and GEMV row splits: bit for bit the per-op result)
//                    in one OpenMP region with barriers between dependent phases, instead of ~9
//                    dispatcher calls, Python steps and parallel regions per layer
// float32 or bfloat16 (math in float32; bfloat16 results rounded where the ATen path rounds its
// op outputs, so RMSNorm, SwiGLU and RoPE give ATen's bits), row-major, CPU; bad shapes and
// dtypes raise c10::Error (RuntimeError in Python).
// Parallel regions use ATen's thread pool (at::parallel_for; decode_layers an `omp parallel` of
// at::get_num_threads() threads on the same libgomp), never a second OpenMP runtime.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <omp.h>

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kGrain = 32768;  // elements below which a loop stays on the calling thread

using bf16_t = uint16_t;  // bfloat16 bits (at::BFloat16's layout)

// A float32 or bfloat16 CPU tensor, of `like`'s dtype when given.
void check_num(const at::Tensor& t, const char* name, const at::Tensor* like = nullptr) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              name, " must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(like == nullptr || t.scalar_type() == like->scalar_type(), name, " must have the dtype of the others");
}

template <typename T>
T* ptr(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

inline float to_f(float x) { return x; }
inline float to_f(bf16_t x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16); }
template <typename T> inline T from_f(float x);
template <> inline float from_f<float>(float x) { return x; }
// round to nearest even, as torch's float -> bfloat16 (NaN payloads aside)
template <> inline bf16_t from_f<bf16_t>(float x) {
  uint32_t u = __builtin_bit_cast(uint32_t, x);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<bf16_t>(u >> 16);
}
// x as a T holds it (rounded to bfloat16, or unchanged for float): where the ATen path rounds
// an intermediate to the tensor dtype, the kernels round there too.
template <typename T> inline float round_to(float x) { return to_f(from_f<T>(x)); }

// Runs the statements with T = float or bf16_t after `t`'s dtype.
#define PD_DISPATCH(t, ...)                       \
  if ((t).scalar_type() == at::kBFloat16) {       \
    using T = bf16_t;                              \
    __VA_ARGS__                                    \
  } else {                                         \
    using T = float;                               \
    __VA_ARGS__                                    \
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
// RMSNorm of the (updated) x scaled by w [H]. bfloat16: the sum rounds to bf16 (torch's add),
// the norm runs in float32 and rounds before the bf16 scale (HF's LlamaRMSNorm order).
template <typename T>
void add_rms_norm_row(T* xr, const T* dr, const T* wp, T* o, int64_t h, float eps) {
  if (dr) {
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) xr[i] = from_f<T>(to_f(xr[i]) + to_f(dr[i]));
  }
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < h; ++i) ss += to_f(xr[i]) * to_f(xr[i]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) o[i] = from_f<T>(to_f(wp[i]) * round_to<T>(to_f(xr[i]) * inv));
}

template <typename T>
void add_rms_norm_impl(T* xp, const T* dp, const T* wp, T* op, int64_t t, int64_t h, float eps) {
  at::parallel_for(0, t, std::max<int64_t>(1, kGrain / h), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) add_rms_norm_row<T>(xp + r * h, dp ? dp + r * h : nullptr, wp, op + r * h, h, eps);
  });
}

at::Tensor add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& delta, const at::Tensor& w,
                        double eps) {
  check_num(x, "x");
  check_num(w, "w", &x);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, H] tensor");
  const int64_t t = x.size(0), h = x.size(1);
  TORCH_CHECK(w.numel() == h && w.is_contiguous(), "w must be [H]");
  at::Tensor d;
  if (delta.has_value()) {
    d = delta->contiguous();
    check_num(d, "delta", &x);
    TORCH_CHECK(d.sizes() == x.sizes(), "delta must have x's shape");
  }
  at::Tensor out = at::empty_like(x);
  PD_DISPATCH(x, add_rms_norm_impl<T>(ptr<T>(x), d.defined() ? ptr<T>(d) : nullptr, ptr<T>(w), ptr<T>(out), t, h,
                                      static_cast<float>(eps));)
  return out;
}

// rope_store_kv's loops (below). bfloat16: each product and the sum round to bf16, as
// apply_rope's x * cos + roll(x) * sin does in that dtype.
template <typename T>
void rope_head(T* x, const T* c, const T* s, int64_t hd, float* tmp) {
  const int64_t half = hd / 2;
  for (int64_t d = 0; d < hd; ++d) tmp[d] = to_f(x[d]);
  // x * cos + roll(x, half) * signed_sin (engine.layers.apply_rope)
#pragma omp simd
  for (int64_t d = 0; d < half; ++d)
    x[d] = from_f<T>(round_to<T>(tmp[d] * to_f(c[d])) + round_to<T>(tmp[d + half] * to_f(s[d])));
#pragma omp simd
  for (int64_t d = half; d < hd; ++d)
    x[d] = from_f<T>(round_to<T>(tmp[d] * to_f(c[d])) + round_to<T>(tmp[d - half] * to_f(s[d])));
}

template <typename T>
void rope_store_kv_impl(T* qp, T* cp, const T* ct, const T* st, const int64_t* pp, const int64_t* bp,
                        const int64_t* ofp, int64_t t, int64_t num_heads, int64_t kvh, int64_t hd, int64_t bs,
                        int64_t nlayers, int64_t layer) {
  const int64_t heads = num_heads + 2 * kvh;
  const int64_t row = bs * kvh * hd;  // one block's K (or V) of one layer
  at::parallel_for(0, t, std::max<int64_t>(1, kGrain / (heads * hd)), [&](int64_t b, int64_t e) {
    std::vector<float> tmp(hd);
    for (int64_t i = b; i < e; ++i) {
      const T* c = ct + pp[i] * hd;
      const T* s = st + pp[i] * hd;
      T* tok = qp + i * heads * hd;
      for (int64_t h = 0; h < num_heads + kvh; ++h) rope_head<T>(tok + h * hd, c, s, hd, tmp.data());
      T* kdst = cp + ((bp[i] * nlayers + layer) * 2) * row + ofp[i] * kvh * hd;
      std::copy(tok + num_heads * hd, tok + (num_heads + kvh) * hd, kdst);
      std::copy(tok + (num_heads + kvh) * hd, tok + heads * hd, kdst + row);
    }
  });
}

// qkv [T, nh + 2 * kvh, hd] (contiguous; q heads, then k heads, then v heads): RoPE on the first
// nh + kvh heads in place with cos/signed-sin table rows [P, hd] at positions [T]; then k and v
// of token i are written to kv_cache[slot_blocks[i], layer, 0/1, slot_offsets[i]]
// (kv_cache [N, L, 2, bs, kvh, hd], contiguous).
void rope_store_kv(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& positions, at::Tensor kv_cache, int64_t layer,
                   const at::Tensor& slot_blocks, const at::Tensor& slot_offsets, int64_t num_heads) {
  check_num(qkv, "qkv");
  check_num(kv_cache, "kv_cache", &qkv);
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous(), "qkv must be a contiguous [T, heads, hd] tensor");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous(), "kv_cache must be a contiguous 6-D cache");
  const int64_t t = qkv.size(0), hd = qkv.size(2), kvh = kv_cache.size(4), bs = kv_cache.size(3);
  const int64_t nblocks = kv_cache.size(0), nlayers = kv_cache.size(1);
  TORCH_CHECK(qkv.size(1) == num_heads + 2 * kvh && kv_cache.size(5) == hd, "qkv and kv_cache disagree");
  TORCH_CHECK(hd % 2 == 0 && layer >= 0 && layer < nlayers, "bad head_dim or layer");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == hd && sin.sizes() == cos.sizes(),
              "cos/sin must be contiguous [P, hd]");
  check_num(cos, "cos", &qkv);
  check_num(sin, "sin", &qkv);
  auto pos = positions.to(at::kLong).contiguous();
  auto blk = slot_blocks.to(at::kLong).contiguous();
  auto off = slot_offsets.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == t && blk.numel() == t && off.numel() == t, "one position and slot per token");
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* bp = blk.data_ptr<int64_t>();
  const int64_t* ofp = off.data_ptr<int64_t>();
  const int64_t p_max = cos.size(0);
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(pp[i] >= 0 && pp[i] < p_max, "position ", pp[i], " outside the RoPE table");
    TORCH_CHECK(bp[i] >= 0 && bp[i] < nblocks && ofp[i] >= 0 && ofp[i] < bs, "slot outside the cache");
  }
  PD_DISPATCH(qkv, rope_store_kv_impl<T>(ptr<T>(qkv), ptr<T>(kv_cache), ptr<T>(cos), ptr<T>(sin), pp, bp, ofp, t,
                                         num_heads, kvh, hd, bs, nlayers, layer);)
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

struct DecodeShape {
  int64_t d, nh, hd, kvh, bs, nb, nlayers, layer, qs0, qs1;
};

// One thread's scratch for decode_attention units (reused across units and layers).
struct AttendScratch {
  std::vector<float> score, qbuf, kbuf, vbuf, obuf;
  std::vector<const float*> kptr, vptr;
};

// Unit u = (sequence u / kvh, KV head u % kvh) of decode_attention. bfloat16: the unit's q heads,
// keys and values are widened to float32 first (one pass; the math is the float32 path's), the
// output rounded once.
template <typename T>
void decode_unit(const T* qp, const T* cp, T* op, const int64_t* tp, const int64_t* rp, const DecodeShape& sh,
                 float scale, int64_t u, AttendScratch& sc) {
  constexpr bool wide = std::is_same<T, float>::value;
  const int64_t hd = sh.hd, group = sh.nh / sh.kvh, row = sh.bs * sh.kvh * hd;
  auto& [score, qbuf, kbuf, vbuf, obuf, kptr, vptr] = sc;
  const int64_t r = u / sh.kvh, g = u % sh.kvh, lo = rp[2 * r], hi = rp[2 * r + 1], n = hi - lo;
  kptr.resize(n);
  vptr.resize(n);
  if (!wide) {
    kbuf.resize(n * hd);
    vbuf.resize(n * hd);
  }
  for (int64_t j = lo, blk = lo / sh.bs, off = lo % sh.bs; j < hi; ++j) {  // no division per key
    const T* k = cp + ((tp[r * sh.nb + blk] * sh.nlayers + sh.layer) * 2) * row + (off * sh.kvh + g) * hd;
    if constexpr (wide) {
      kptr[j - lo] = k;
      vptr[j - lo] = k + row;
    } else {
      float* kf = kbuf.data() + (j - lo) * hd;
      float* vf = vbuf.data() + (j - lo) * hd;
      for (int64_t c = 0; c < hd; ++c) kf[c] = to_f(k[c]), vf[c] = to_f(k[row + c]);
      kptr[j - lo] = kf;
      vptr[j - lo] = vf;
    }
    if (++off == sh.bs) off = 0, ++blk;
  }
  const T* q = qp + r * sh.qs0 + g * group * sh.qs1;
  T* o = op + (r * sh.nh + g * group) * hd;
  if constexpr (wide) {
    attend_kv_head(q, sh.qs1, group, kptr.data(), vptr.data(), n, hd, scale, o, score);
  } else {
    qbuf.resize(group * hd);
    obuf.resize(group * hd);
    for (int64_t a = 0; a < group; ++a)
      for (int64_t c = 0; c < hd; ++c) qbuf[a * hd + c] = to_f(q[a * sh.qs1 + c]);
    attend_kv_head(qbuf.data(), hd, group, kptr.data(), vptr.data(), n, hd, scale, obuf.data(), score);
    for (int64_t i = 0; i < group * hd; ++i) o[i] = from_f<T>(obuf[i]);
  }
}

// decode_attention's loop over (sequence, KV head) units.
template <typename T>
void decode_attention_impl(const T* qp, const T* cp, T* op, const int64_t* tp, const int64_t* rp,
                           const DecodeShape& sh, float scale, int64_t grain) {
  at::parallel_for(0, sh.d * sh.kvh, grain, [&](int64_t b, int64_t e) {
    AttendScratch sc;
    for (int64_t u = b; u < e; ++u) decode_unit<T>(qp, cp, op, tp, rp, sh, scale, u, sc);
  });
}

// Checks that each of the d rows' key range [lo, hi) (rp [d, 2]) is non-empty and inside its row of
// the block table tp [d, nb], whose blocks must lie in the cache. Returns the number of keys.
int64_t check_key_ranges(const int64_t* tp, const int64_t* rp, int64_t d, int64_t nb, int64_t bs, int64_t nblocks) {
  int64_t keys = 0;
  for (int64_t r = 0; r < d; ++r) {
    TORCH_CHECK(0 <= rp[2 * r] && rp[2 * r] < rp[2 * r + 1] && rp[2 * r + 1] <= nb * bs, "bad key range");
    for (int64_t j = rp[2 * r] / bs; j < (rp[2 * r + 1] + bs - 1) / bs; ++j)
      TORCH_CHECK(0 <= tp[r * nb + j] && tp[r * nb + j] < nblocks, "block id outside the cache");
    keys += rp[2 * r + 1] - rp[2 * r];
  }
  return keys;
}

// q [D, nh, hd] (rows may be strided: a view of qkv); tables [D, nb] block ids; key_ranges
// [D, 2]: row r attends to keys [lo, hi) of its table (key j = token j % bs of block j / bs).
// Returns softmax(q k^T * scale) v per query head, [D, nh, hd]; query head h reads KV head
// h / (nh / kvh) (HF repeat_kv). Softmax in float32 with the row max subtracted (SDPA's).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, int64_t layer,
                            const at::Tensor& tables, const at::Tensor& key_ranges, double scale) {
  check_num(q, "q");
  check_num(kv_cache, "kv_cache", &q);
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
  const int64_t keys = check_key_ranges(tp, rp, d, nb, bs, nblocks);
  at::Tensor out = at::empty({d, nh, hd}, q.options());
  const int64_t group = nh / kvh;
  // about kGrain multiply-adds of work per task
  const int64_t grain = std::max<int64_t>(1, (kGrain * d * kvh) / std::max<int64_t>(1, 2 * keys * hd * group));
  const DecodeShape shape{d, nh, hd, kvh, bs, nb, nlayers, layer, q.stride(0), q.stride(1)};
  PD_DISPATCH(q, decode_attention_impl<T>(ptr<T>(q), ptr<T>(kv_cache), ptr<T>(out), tp, rp, shape,
                                          static_cast<float>(scale), grain);)
  return out;
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16_t* p) {  // 8 bfloat16 -> float32 (the bits shifted up)
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#endif

// The GEMV weight layout ("panels", written by engine.gemv_layout.to_gemv_panels): w [N, K] with
// N4 = N - N % 4 and K16 = K - K % 16 holds rows [0, N4) as N4 / 4 panels of 4 rows, 4 K elements
// each: first the K16 / 16 column chunks, each chunk the 16 elements of row 0, then of row 1, 2, 3
// (64 elements); then the K - K16 last columns of row 0, then of row 1, 2, 3. Rows [N4, N) follow,
// row-major (at n * K, as in a dense matrix). A 4-row block of the kernels below thus reads one
// ascending stream of addresses instead of four rows 4 K apart, which the hardware prefetcher
// follows as well as a plain sum's (products ~20% faster than on row-major rows on an AVX2 EPYC:
// docs/benchmarks.md, issue 11).
template <typename T>
inline const T* panel_of(const T* w, int64_t n, int64_t k) { return w + (n / 4) * 4 * k; }
// Element (i, c) of a panel (row i of its 4, column c).
template <typename T>
inline T panel_at(const T* p, int64_t i, int64_t c, int64_t k, int64_t k16) {
  return c < k16 ? p[(c / 16) * 64 + i * 16 + c % 16] : p[4 * k16 + i * (k - k16) + (c - k16)];
}

// y[n] = w[n, :] . x for rows [n0, n1) of w [N, K] in the panel layout above (float32 or
// bfloat16, widened as it streams; x float32): a panel's four rows at once (x stays in L1), two
// accumulators per row. n0 is a multiple of 4 and so is n1 unless n1 == N (gemv_split's shares),
// so the one-row tail loop only meets rows [N4, N), which are row-major.
template <typename T>
void gemv_rows(const float* x, const T* w, float* y, int64_t k, int64_t n0, int64_t n1) {
  int64_t n = n0;
  const int64_t k16 = k - k % 16;
#if defined(__AVX2__) && defined(__FMA__)
  for (; n + 4 <= n1; n += 4) {
    const T* p = panel_of(w, n, k);
    __m256 a[4], b[4];
    for (int i = 0; i < 4; ++i) a[i] = b[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < k16; c += 16) {
      const __m256 x0 = _mm256_loadu_ps(x + c), x1 = _mm256_loadu_ps(x + c + 8);
      const T* q = p + c * 4;
      for (int i = 0; i < 4; ++i) {
        a[i] = _mm256_fmadd_ps(load8(q + i * 16), x0, a[i]);
        b[i] = _mm256_fmadd_ps(load8(q + i * 16 + 8), x1, b[i]);
      }
    }
    for (int i = 0; i < 4; ++i) {
      const __m256 s = _mm256_add_ps(a[i], b[i]);
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      h = _mm_add_ss(h, _mm_movehdup_ps(h));
      float acc = _mm_cvtss_f32(h);
      for (int64_t c = k16; c < k; ++c) acc += to_f(panel_at(p, i, c, k, k16)) * x[c];
      y[n + i] = acc;
    }
  }
#else
  for (; n + 4 <= n1; n += 4) {  // a full 4-row block is a panel (n + 4 <= N4); portable build
    const T* p = panel_of(w, n, k);
    for (int i = 0; i < 4; ++i) {
      float acc = 0.f;
      for (int64_t c = 0; c < k; ++c) acc += to_f(panel_at(p, i, c, k, k16)) * x[c];
      y[n + i] = acc;
    }
  }
#endif
  for (; n < n1; ++n) {
    const T* wr = w + n * k;  // a row-major tail row (see above)
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t c = 0; c < k; ++c) acc += to_f(wr[c]) * x[c];
    y[n] = acc;
  }
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load16(const bf16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// gemv_rows with 512-bit vectors, for CPUs with AVX-512 (chosen at run time: the library is
// built for x86-64-v3).
template <typename T>
__attribute__((target("avx512f"))) void gemv_rows_avx512(const float* x, const T* w, float* y, int64_t k,
                                                          int64_t n0, int64_t n1) {
  int64_t n = n0;
  const int64_t k32 = k - k % 32, k16 = k - k % 16;
  for (; n + 4 <= n1; n += 4) {
    const T* p = panel_of(w, n, k);
    __m512 a[4], b[4];
    for (int i = 0; i < 4; ++i) a[i] = b[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < k32; c += 32) {  // two 16-column chunks of the panel: 128 contiguous elements
      const __m512 x0 = _mm512_loadu_ps(x + c), x1 = _mm512_loadu_ps(x + c + 16);
      const T* q = p + c * 4;
      for (int i = 0; i < 4; ++i) {
        a[i] = _mm512_fmadd_ps(load16(q + i * 16), x0, a[i]);
        b[i] = _mm512_fmadd_ps(load16(q + 64 + i * 16), x1, b[i]);
      }
    }
    for (int i = 0; i < 4; ++i) {
      float acc = _mm512_reduce_add_ps(_mm512_add_ps(a[i], b[i]));
      for (int64_t c = k32; c < k; ++c) acc += to_f(panel_at(p, i, c, k, k16)) * x[c];
      y[n + i] = acc;
    }
  }
  gemv_rows(x, w, y, k, n, n1);  // the last < 4 rows
}
bool has_avx512() {
  static const bool yes = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f"));
  return yes;
}
#else
template <typename T>
void gemv_rows_avx512(const float* x, const T* w, float* y, int64_t k, int64_t n0, int64_t n1) {
  gemv_rows(x, w, y, k, n0, n1);
}
bool has_avx512() { return false; }
#endif

// How gemv splits w [n, k]'s rows: `tasks` contiguous shares of `share` rows (a multiple of 4, so
// every row but the last n % 4 runs in a 4-row block, whatever the split), one per thread.
struct GemvSplit {
  int64_t tasks, share;
};
inline GemvSplit gemv_split(int64_t n, int64_t k, int64_t threads) {
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, (n * k) / kGrain));
  return {nt, ((n + nt - 1) / nt + 3) / 4 * 4};
}
inline std::pair<int64_t, int64_t> gemv_rows_of(int64_t n, const GemvSplit& sp, int64_t t) {
  return {std::min(n, t * sp.share), std::min(n, (t + 1) * sp.share)};
}

// Task t of a GemvSplit: y[n0:n1] of x . w^T.
template <typename T>
void gemv_task(const float* x, const T* w, float* y, int64_t k, int64_t n, const GemvSplit& sp, int64_t t) {
  const auto [n0, n1] = gemv_rows_of(n, sp, t);
  has_avx512() ? gemv_rows_avx512<T>(x, w, y, k, n0, n1) : gemv_rows<T>(x, w, y, k, n0, n1);
}

template <typename T>
void gemv_impl(const T* xp, const T* wp, const T* bp, T* yp, int64_t n, int64_t k) {
  std::vector<float> xf, yf;
  const float* x = nullptr;
  float* y = nullptr;
  if constexpr (std::is_same<T, float>::value) {
    x = xp, y = yp;
  } else {
    xf.resize(k), yf.resize(n);
    for (int64_t c = 0; c < k; ++c) xf[c] = to_f(xp[c]);
    x = xf.data(), y = yf.data();
  }
  const GemvSplit sp = gemv_split(n, k, at::get_num_threads());
  at::parallel_for(0, sp.tasks, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) gemv_task<T>(x, wp, y, k, n, sp, t);
  });
  for (int64_t i = 0; i < n; ++i) yp[i] = from_f<T>(y[i] + (bp ? to_f(bp[i]) : 0.f));
}

// x [1, K] @ w [N, K]^T (+ bias [N]) -> [1, N] for a dense float32 or bfloat16 w: the batch-1
// product of a decode step, read at close to the memory bandwidth (each thread streams one
// contiguous share of the rows), accumulated in float32 (bfloat16: rounded once, with the bias
// added first, as oneDNN's bf16 linear). engine.cpu_linear uses it for one-row inputs; more rows
// go to oneDNN.
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  check_num(x, "x");
  check_num(w, "w", &x);
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && w.dim() == 2 && w.size(1) == x.size(1) && w.is_contiguous(),
              "gemv takes x [1, K] and a contiguous w [N, K]");
  const int64_t n = w.size(0), k = w.size(1);
  at::Tensor xc = x.contiguous();
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    check_num(b, "bias", &x);
    TORCH_CHECK(b.numel() == n, "bias must be [N]");
  }
  at::Tensor y = at::empty({1, n}, x.options());
  PD_DISPATCH(x, gemv_impl<T>(ptr<T>(xc), ptr<T>(w), b.defined() ? ptr<T>(b) : nullptr, ptr<T>(y), n, k);)
  return y;
}

// gate_up [T, 2I] (gate then up) -> silu(gate) * up [T, I]; bfloat16: silu rounds to bf16
// before the product (torch's F.silu(gate) * up).
template <typename T>
void silu_mul_row(const T* g, const T* u, T* o, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gi = to_f(g[i]);
    o[i] = from_f<T>(round_to<T>(gi / (1.f + exp_f32(-gi))) * to_f(u[i]));
  }
}

template <typename T>
void silu_mul_impl(const T* gp, T* op, int64_t t, int64_t n) {
  at::parallel_for(0, t, std::max<int64_t>(1, kGrain / (2 * n)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) silu_mul_row<T>(gp + r * 2 * n, gp + r * 2 * n + n, op + r * n, n);
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_num(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous [T, 2I] tensor");
  const int64_t t = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({t, n}, gate_up.options());
  PD_DISPATCH(gate_up, silu_mul_impl<T>(ptr<T>(gate_up), ptr<T>(out), t, n);)
  return out;
}


// ---- decode_layers: every decoder layer of a batch-1 decode step in one parallel region ----

// One decoder layer's weights (dense, row-major, the activations' dtype); qkv_bias may be null.
template <typename T>
struct LayerPtrs {
  const T *attn_norm, *qkv, *qkv_bias, *o_proj, *mlp_norm, *gate_up, *down;
};

// The step's one token: model sizes, its position's RoPE rows, its KV slot, its block table row.
template <typename T>
struct TokenStep {
  int64_t h, nh, kvh, hd, inter;  // hidden, q heads, KV heads, head dim, intermediate
  float eps, scale;
  const T *cos, *sin;              // [hd] rows at the token's position
  T* cache;                        // kv_cache [N, L, 2, bs, kvh, hd]
  int64_t bs, nlayers, nb, slot_block, slot_offset;
  const int64_t *table, *key_range;  // [nb], [2]
};

// The activations of one layer (T) and the float32 copies the GEMV reads (bfloat16 only; for
// float32 `in` is unused and the GEMVs read the T buffers).
template <typename T>
struct Activations {
  T *x, *h, *qkv, *attn, *attn_out, *gate_up, *act, *delta;
  float *in, *y;  // GEMV input [max(H, nh hd, I)], GEMV output [max(N)]
};

// x as the GEMV's float32 input: itself (float32) or its widened copy in `in`, filled by the
// caller over [i0, i1) (bfloat16).
template <typename T>
const float* gemv_input(const T* x, float* in) {
  if constexpr (std::is_same<T, float>::value) return x;
  return in;
}
template <typename T>
void widen(const T* x, float* in, int64_t i0, int64_t i1) {
  if constexpr (!std::is_same<T, float>::value)
    for (int64_t i = i0; i < i1; ++i) in[i] = to_f(x[i]);
}

// This thread's tasks of gemv's split of w [n, k] (gemv_split over `threads`: the same rows per
// task, so the same bits, as gemv), then their rows of out = y (+ bias) rounded to T.
template <typename T>
void gemv_tasks(const float* x, const T* w, const T* bias, float* yf, T* out, int64_t n, int64_t k,
                int64_t threads, int tid, int team) {
  const GemvSplit sp = gemv_split(n, k, threads);
  float* y = std::is_same<T, float>::value ? reinterpret_cast<float*>(out) : yf;
  for (int64_t t = tid; t < sp.tasks; t += team) {
    gemv_task<T>(x, w, y, k, n, sp, t);
    const auto [n0, n1] = gemv_rows_of(n, sp, t);
    for (int64_t i = n0; i < n1; ++i) out[i] = from_f<T>(y[i] + (bias ? to_f(bias[i]) : 0.f));
  }
}

// KV head g of the token: RoPE on its q heads and k head (qkv [nh + 2 kvh, hd], in place), its
// K/V written into layer `layer` of the cache, then its attention unit (decode_unit) into attn.
template <typename T>
void attend_group(const TokenStep<T>& st, const Activations<T>& a, int64_t layer, int64_t g,
                  AttendScratch& sc, float* tmp) {
  const int64_t hd = st.hd, group = st.nh / st.kvh, row = st.bs * st.kvh * hd;
  for (int64_t q = g * group; q < (g + 1) * group; ++q) rope_head<T>(a.qkv + q * hd, st.cos, st.sin, hd, tmp);
  T* k = a.qkv + (st.nh + g) * hd;
  rope_head<T>(k, st.cos, st.sin, hd, tmp);
  T* kdst = st.cache + ((st.slot_block * st.nlayers + layer) * 2) * row + (st.slot_offset * st.kvh + g) * hd;
  std::copy(k, k + hd, kdst);
  std::copy(k + st.kvh * hd, k + (st.kvh + 1) * hd, kdst + row);  // v head g
  const DecodeShape sh{1, st.nh, hd, st.kvh, st.bs, st.nb, st.nlayers, layer, (st.nh + 2 * st.kvh) * hd, hd};
  decode_unit<T>(a.qkv, st.cache, a.attn, st.table, st.key_range, sh, st.scale, g, sc);
}

// One decoder layer on thread tid of the team (every thread calls it; barriers between the
// phases that read another thread's results). The same inner loops as the per-op kernels.
template <typename T>
void fused_layer(const TokenStep<T>& st, const LayerPtrs<T>& w, const Activations<T>& a, int64_t layer,
                 int64_t threads, int tid, int team, AttendScratch& sc, float* tmp) {
  const int64_t h = st.h, nq = (st.nh + 2 * st.kvh) * st.hd, na = st.nh * st.hd, ni = st.inter;
  if (tid == 0) {  // 576 floats: cheaper on one thread than split
    add_rms_norm_row<T>(a.x, layer == 0 ? nullptr : a.delta, w.attn_norm, a.h, h, st.eps);
    widen<T>(a.h, a.in, 0, h);
  }
#pragma omp barrier
  gemv_tasks<T>(gemv_input<T>(a.h, a.in), w.qkv, w.qkv_bias, a.y, a.qkv, nq, h, threads, tid, team);
#pragma omp barrier
  for (int64_t g = tid; g < st.kvh; g += team) {
    attend_group<T>(st, a, layer, g, sc, tmp);
    const int64_t group_dims = st.nh / st.kvh * st.hd;
    widen<T>(a.attn, a.in, g * group_dims, (g + 1) * group_dims);
  }
#pragma omp barrier
  gemv_tasks<T>(gemv_input<T>(a.attn, a.in), w.o_proj, nullptr, a.y, a.attn_out, h, na, threads, tid, team);
#pragma omp barrier
  if (tid == 0) {
    add_rms_norm_row<T>(a.x, a.attn_out, w.mlp_norm, a.h, h, st.eps);
    widen<T>(a.h, a.in, 0, h);
  }
#pragma omp barrier
  gemv_tasks<T>(gemv_input<T>(a.h, a.in), w.gate_up, nullptr, a.y, a.gate_up, 2 * ni, h, threads, tid, team);
#pragma omp barrier
  {  // SwiGLU in chunks of 16 (elementwise: the same bits as one pass)
    const int64_t chunk = ((ni + team - 1) / team + 15) / 16 * 16;
    const int64_t i0 = std::min(ni, tid * chunk), i1 = std::min(ni, (tid + 1) * chunk);
    silu_mul_row<T>(a.gate_up + i0, a.gate_up + ni + i0, a.act + i0, i1 - i0);
    widen<T>(a.act, a.in, i0, i1);
  }
#pragma omp barrier
  gemv_tasks<T>(gemv_input<T>(a.act, a.in), w.down, nullptr, a.y, a.delta, h, ni, threads, tid, team);
#pragma omp barrier
}

template <typename T>
void decode_layers_impl(const TokenStep<T>& st, const std::vector<LayerPtrs<T>>& layers, const Activations<T>& a) {
  const int64_t threads = at::get_num_threads();
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), team = omp_get_num_threads();
    AttendScratch sc;
    std::vector<float> tmp(st.hd);
    for (int64_t l = 0; l < static_cast<int64_t>(layers.size()); ++l)
      fused_layer<T>(st, layers[l], a, l, threads, tid, team, sc, tmp.data());
  }
}

// Checks w is a contiguous [rows, cols] tensor of x's dtype.
void check_weight(const at::Tensor& w, const at::Tensor& x, int64_t rows, int64_t cols, const char* name) {
  check_num(w, name, &x);
  TORCH_CHECK(w.is_contiguous() && w.dim() == (cols ? 2 : 1) && w.size(0) == rows && (!cols || w.size(1) == cols),
              name, " must be a contiguous ", cols ? "[N, K]" : "[N]", " tensor of the model's shape");
}

// The dense weights of layer l from decode_layers' flat list, checked.
template <typename T>
LayerPtrs<T> layer_ptrs(at::TensorList weights, at::TensorList biases, int64_t l, const at::Tensor& x,
                        int64_t nq, int64_t na, int64_t& inter) {
  const at::Tensor* w = weights.data() + 6 * l;
  const int64_t h = x.size(1);
  if (l == 0) {
    TORCH_CHECK(w[4].dim() == 2 && w[4].size(0) % 2 == 0, "gate_up must be [2I, H]");
    inter = w[4].size(0) / 2;
  }
  check_weight(w[0], x, h, 0, "attn_norm");
  check_weight(w[1], x, nq, h, "qkv");
  check_weight(w[2], x, h, na, "o_proj");
  check_weight(w[3], x, h, 0, "mlp_norm");
  check_weight(w[4], x, 2 * inter, h, "gate_up");
  check_weight(w[5], x, h, inter, "down");
  const T* bias = nullptr;
  if (!biases.empty()) {
    check_weight(biases[l], x, nq, 0, "qkv_bias");
    bias = ptr<T>(biases[l]);
  }
  return {ptr<T>(w[0]), ptr<T>(w[1]), bias, ptr<T>(w[2]), ptr<T>(w[3]), ptr<T>(w[4]), ptr<T>(w[5])};
}

template <typename T>
at::Tensor run_decode_layers(at::Tensor& x, at::TensorList weights, at::TensorList biases, TokenStep<T> st) {
  const int64_t nlayers = static_cast<int64_t>(weights.size()) / 6, nq = (st.nh + 2 * st.kvh) * st.hd;
  const int64_t na = st.nh * st.hd;
  std::vector<LayerPtrs<T>> layers;
  for (int64_t l = 0; l < nlayers; ++l) layers.push_back(layer_ptrs<T>(weights, biases, l, x, nq, na, st.inter));
  const int64_t h = st.h, ni = st.inter;
  std::vector<T> buf(h + nq + na + h + 2 * ni + ni);
  std::vector<float> in(std::max({h, na, ni})), y(std::max({nq, 2 * ni, h}));
  at::Tensor delta = at::empty({1, h}, x.options());
  T* p = buf.data();
  Activations<T> a{ptr<T>(x), p, p + h, p + h + nq, p + h + nq + na, p + 2 * h + nq + na,
                   p + 2 * h + nq + na + 2 * ni, ptr<T>(delta), in.data(), y.data()};
  decode_layers_impl<T>(st, layers, a);
  return delta;
}

// x [1, H] (the embedding of the step's one decode token, updated in place into the residual
// stream before the last MLP); weights: 6 per layer, in layer order (attn_norm [H], qkv
// [(nh + 2 kvh) hd, H], o_proj [H, nh hd], mlp_norm [H], gate_up [2I, H], down [H, I]), all
// dense, contiguous, x's dtype; qkv_biases: [] or one [(nh + 2 kvh) hd] per layer. Layer l reads
// and writes layer l of kv_cache; the token is at `positions` [1] (cos/sin tables [P, hd]), its
// K/V go to slot (slot_blocks [1], slot_offsets [1]) and it attends to keys key_ranges [1, 2] of
// tables [1, nb]. Returns the last layer's MLP output [1, H] (the caller adds it to x).
// Every step is the per-op kernels' inner loop (add_rms_norm, gemv, rope_store_kv,
// decode_attention, silu_mul) with the same split of each GEMV's rows, so the result is bit for
// bit theirs; one OpenMP region for all layers, barriers between dependent phases.
at::Tensor decode_layers(at::Tensor x, at::TensorList weights, at::TensorList qkv_biases, at::Tensor kv_cache,
                         const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                         const at::Tensor& slot_blocks, const at::Tensor& slot_offsets, const at::Tensor& tables,
                         const at::Tensor& key_ranges, double eps, double scale, int64_t num_heads) {
  check_num(x, "x");
  check_num(kv_cache, "kv_cache", &x);
  check_num(cos, "cos", &x);
  check_num(sin, "sin", &x);
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.is_contiguous(), "x must be a contiguous [1, H] tensor");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous(), "kv_cache must be a contiguous 6-D cache");
  const int64_t nlayers = static_cast<int64_t>(weights.size()) / 6;
  TORCH_CHECK(weights.size() % 6 == 0 && nlayers >= 1 && nlayers <= kv_cache.size(1),
              "weights: 6 per layer, at most the cache's layers");
  TORCH_CHECK(qkv_biases.empty() || static_cast<int64_t>(qkv_biases.size()) == nlayers, "one qkv bias per layer");
  const int64_t nblocks = kv_cache.size(0), bs = kv_cache.size(3), kvh = kv_cache.size(4), hd = kv_cache.size(5);
  TORCH_CHECK(num_heads > 0 && num_heads % kvh == 0 && hd % 2 == 0, "bad head counts");
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == hd &&
              sin.sizes() == cos.sizes(), "cos/sin must be contiguous [P, hd]");
  auto pos = positions.to(at::kLong).contiguous(), blk = slot_blocks.to(at::kLong).contiguous();
  auto off = slot_offsets.to(at::kLong).contiguous();
  auto tab = tables.to(at::kLong).contiguous(), rng = key_ranges.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == 1 && blk.numel() == 1 && off.numel() == 1, "one position and slot");
  TORCH_CHECK(tab.dim() == 2 && tab.size(0) == 1 && rng.numel() == 2, "tables [1, nb] and key_ranges [1, 2]");
  const int64_t p = pos.item<int64_t>(), b = blk.item<int64_t>(), o = off.item<int64_t>(), nb = tab.size(1);
  TORCH_CHECK(p >= 0 && p < cos.size(0), "position ", p, " outside the RoPE table");
  TORCH_CHECK(b >= 0 && b < nblocks && o >= 0 && o < bs, "slot outside the cache");
  check_key_ranges(tab.data_ptr<int64_t>(), rng.data_ptr<int64_t>(), 1, nb, bs, nblocks);
  at::Tensor out;
  PD_DISPATCH(x, {
    const TokenStep<T> st{x.size(1), num_heads, kvh, hd, 0, static_cast<float>(eps), static_cast<float>(scale),
                          ptr<T>(cos) + p * hd, ptr<T>(sin) + p * hd, ptr<T>(kv_cache), bs, kv_cache.size(1), nb, b,
                          o, tab.data_ptr<int64_t>(), rng.data_ptr<int64_t>()};
    out = run_decode_layers<T>(x, weights, qkv_biases, st);
  })
  return out;
}

// logits [R, V] float32 -> [R] int64: each row's first index of its largest value, a NaN counting
// as larger than any number (the first NaN wins), as torch.argmax(logits, -1) on the CPU. One
// thread, per row one vectorized pass (the max and a NaN flag) and one scan to its first index,
// over a row still in cache (the lm_head product just wrote it): no TensorIterator set-up and no
// parallel region for 49k floats (36 us against torch.argmax's 159 us on [1, 49152], AVX2 EPYC).
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.device().is_cpu() &&
              logits.size(1) > 0, "argmax_rows takes a float32 CPU tensor [R, V] with V > 0");
  const at::Tensor l = logits.contiguous();
  const int64_t rows = l.size(0), v = l.size(1);
  at::Tensor out = at::empty({rows}, l.options().dtype(at::kLong));
  const float* p = l.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r, p += v) {
    int nan = 0;
    float best = p[0];
#pragma omp simd reduction(| : nan) reduction(max : best)
    for (int64_t i = 0; i < v; ++i) {
      nan |= p[i] != p[i];
      best = p[i] > best ? p[i] : best;
    }
    int64_t at = 0;
    if (nan) {
      while (p[at] == p[at]) ++at;
    } else {
      while (p[at] != best) ++at;
    }
    o[r] = at;
  }
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
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("decode_layers(Tensor(a!) x, Tensor[] weights, Tensor[] qkv_biases, Tensor(b!) kv_cache, Tensor cos, "
        "Tensor sin, Tensor positions, Tensor slot_blocks, Tensor slot_offsets, Tensor tables, Tensor key_ranges, "
        "float eps, float scale, int num_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("rope_store_kv", rope_store_kv);
  m.impl("decode_attention", decode_attention);
  m.impl("silu_mul", silu_mul);
  m.impl("gemv", gemv);
  m.impl("argmax_rows", argmax_rows);
  m.impl("decode_layers", decode_layers);
}
