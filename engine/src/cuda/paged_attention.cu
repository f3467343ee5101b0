// Decode attention over the paged KV cache: one new query row per sequence, reading K/V
// straight from the cache slots the sequence owns (no gather copy), for the `cuda` build.
//
// The cache is per layer `[num_slots, num_kv_heads * head_dim]`, f16 or f32; a sequence's
// context is a list of slots (`slots[offsets[r] .. offsets[r + 1]]` for row r, in position
// order). One thread block computes one query head of one row:
//   1. scores: one warp per key position, lanes split the head dimension (a key row of one
//      head is head_dim contiguous elements, so a warp's reads coalesce);
//   2. softmax: block-wide max and sum, scores kept in a global scratch row;
//   3. output: threads own (position group, dimension) pairs, so consecutive threads read
//      consecutive V elements; the groups are summed in shared memory.
// Math in f32 with expf, like the CPU kernel, so the two agree to rounding.

#include <cuda_fp16.h>
#include <float.h>

#define PD_THREADS 256
#define PD_MAX_HEAD_DIM 256

__device__ __forceinline__ float pd_to_f32(float x) { return x; }
__device__ __forceinline__ float pd_to_f32(__half x) { return __half2float(x); }

__device__ __forceinline__ float pd_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Reduces one value per warp (already warp-uniform) to a block-wide value, max or sum.
__device__ __forceinline__ float pd_block_reduce(float v, bool is_max, float* warp_vals) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (lane == 0) warp_vals[warp] = v;
    __syncthreads();
    float r = warp_vals[0];
    for (int w = 1; w < warps; ++w) r = is_max ? fmaxf(r, warp_vals[w]) : r + warp_vals[w];
    __syncthreads();
    return r;
}

template <typename T>
__device__ void pd_paged_decode(float* __restrict__ out, float* __restrict__ scratch,
                                const float* __restrict__ q, const T* __restrict__ k_cache,
                                const T* __restrict__ v_cache, const unsigned* __restrict__ slots,
                                const unsigned* __restrict__ offsets, int num_heads, int num_kv_heads,
                                int head_dim, int max_ctx, float scale) {
    __shared__ float q_s[PD_MAX_HEAD_DIM];
    __shared__ float part[PD_THREADS];
    __shared__ float warp_vals[PD_THREADS / 32];

    const int head = blockIdx.x, row = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
    const int kv_head = head / (num_heads / num_kv_heads);
    const size_t kv_width = (size_t)num_kv_heads * head_dim;
    const unsigned begin = offsets[row];
    const int ctx = (int)(offsets[row + 1] - begin);
    const unsigned* row_slots = slots + begin;
    const float* qh = q + ((size_t)row * num_heads + head) * head_dim;
    float* scores = scratch + ((size_t)row * num_heads + head) * max_ctx;
    float* oh = out + ((size_t)row * num_heads + head) * head_dim;

    for (int d = tid; d < head_dim; d += blockDim.x) q_s[d] = qh[d];
    __syncthreads();

    // 1. scores, one warp per key position.
    float m = -FLT_MAX;
    for (int t = warp; t < ctx; t += warps) {
        const T* kr = k_cache + (size_t)row_slots[t] * kv_width + (size_t)kv_head * head_dim;
        float s = 0.f;
        for (int d = lane; d < head_dim; d += 32) s += q_s[d] * pd_to_f32(kr[d]);
        s = pd_warp_sum(s) * scale;
        if (lane == 0) scores[t] = s;
        m = fmaxf(m, s);
    }
    const float max_score = pd_block_reduce(m, true, warp_vals);

    // 2. softmax weights (unnormalised) and their sum.
    float sum = 0.f;
    for (int t = tid; t < ctx; t += blockDim.x) {
        const float e = expf(scores[t] - max_score);
        scores[t] = e;
        sum += e;
    }
    const float total = pd_block_reduce(pd_warp_sum(sum), false, warp_vals);

    // 3. weighted sum of V: `groups` position groups of head_dim threads each.
    const int groups = blockDim.x / head_dim;
    const int g = tid / head_dim, d = tid % head_dim;
    float acc = 0.f;
    if (g < groups) {
        for (int t = g; t < ctx; t += groups) {
            const T* vr = v_cache + (size_t)row_slots[t] * kv_width + (size_t)kv_head * head_dim;
            acc += scores[t] * pd_to_f32(vr[d]);
        }
    }
    part[tid] = acc;
    __syncthreads();
    if (tid < head_dim) {
        float o = 0.f;
        for (int i = 0; i < groups; ++i) o += part[i * head_dim + tid];
        oh[tid] = ctx > 0 ? o / total : 0.f;
    }
}

extern "C" __global__ void __launch_bounds__(PD_THREADS)
pd_paged_decode_f16(float* out, float* scratch, const float* q, const __half* k_cache, const __half* v_cache,
                    const unsigned* slots, const unsigned* offsets, int num_heads, int num_kv_heads, int head_dim,
                    int max_ctx, float scale) {
    pd_paged_decode<__half>(out, scratch, q, k_cache, v_cache, slots, offsets, num_heads, num_kv_heads, head_dim,
                            max_ctx, scale);
}

extern "C" __global__ void __launch_bounds__(PD_THREADS)
pd_paged_decode_f32(float* out, float* scratch, const float* q, const float* k_cache, const float* v_cache,
                    const unsigned* slots, const unsigned* offsets, int num_heads, int num_kv_heads, int head_dim,
                    int max_ctx, float scale) {
    pd_paged_decode<float>(out, scratch, q, k_cache, v_cache, slots, offsets, num_heads, num_kv_heads, head_dim,
                           max_ctx, scale);
}
