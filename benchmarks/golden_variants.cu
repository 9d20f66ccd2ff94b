/* Golden fp64 attention (cuda/golden.cu) timed on its own, for comparing versions of the kernel in one run on one GPU
 * (no fadev build): the kernel source is #included (GOLDEN_SRC, default this tree's; an older copy whose includes
 * point at cuda/ works too), its few host helpers are stubbed here.
 *
 *   nvcc -O3 -std=c++17 --fmad=false -arch=sm_90 [-DGOLDEN_SRC='"old_golden.cu"'] [-DGOLDEN_BLOCK_N_64=32 ...] \
 *        benchmarks/golden_variants.cu [-lcublas] -o golden_variants && ./golden_variants [repeats]
 *
 * Prints cuBLAS's DGEMM rate (8192^3, where cuBLAS is linked; zero matrices, so a higher clock than random data
 * gets: benchmarks/gpu.py --parts golden gives the rate of record against torch's fp64 matmul on random data),
 * then the relative error against a plain fp64 CPU attention on small shapes (D 40, 64, 128, causal and not) and
 * TFLOP/s at B 1, H 16, N 4096 and B 1, H 4, N 16384, D 64 and 128 (best of the repeats, 5 calls each). With two
 * arguments (repeats, D): one N 4096 call pair at that D, for ncu. */
#include <cuda_runtime.h>
#if __has_include(<cublas_v2.h>)
#include <cublas_v2.h>
#define HAVE_CUBLAS 1
#endif
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <vector>
#ifndef GOLDEN_SRC
#define GOLDEN_SRC "../cuda/golden.cu"
#endif
#include GOLDEN_SRC

fadev_status fadev_cuda_fail(cudaError_t err, const char *where) { fprintf(stderr, "%s: %s\n", where, cudaGetErrorString(err)); return FADEV_ERR_CUDA; }
fadev_status fadev_cuda_fail_msg(fadev_status st, const char *m) { fprintf(stderr, "%s\n", m); return st; }
fadev_status fadev_cuda_require_device(void) { return FADEV_OK; }
fadev_status fadev_cuda_finish(const char *w) { cudaError_t e = cudaDeviceSynchronize(); return e == cudaSuccess ? FADEV_OK : fadev_cuda_fail(e, w); }
extern "C" fadev_status att_check_params(const fadev_attention_params *, int, int, const char **) { return FADEV_OK; }

static void reference(const std::vector<double> &q, const std::vector<double> &k, const std::vector<double> &v,
                      std::vector<double> &o, int H, int Hkv, int N, int D, int causal, double scale) {
    std::vector<double> s(N);
    for (int h = 0; h < H; h++) for (int i = 0; i < N; i++) {
        const double *qi = &q[((size_t)h * N + i) * D];
        int kh = h / (H / Hkv), lim = causal ? i + 1 : N;
        double m = -INFINITY;
        for (int j = 0; j < lim; j++) { const double *kj = &k[((size_t)kh * N + j) * D]; double acc = 0;
            for (int d = 0; d < D; d++) acc += qi[d] * kj[d]; s[j] = scale * acc; m = fmax(m, s[j]); }
        double l = 0; for (int j = 0; j < lim; j++) { s[j] = exp(s[j] - m); l += s[j]; }
        for (int d = 0; d < D; d++) { double acc = 0; for (int j = 0; j < lim; j++) acc += s[j] * v[((size_t)kh * N + j) * D + d];
            o[((size_t)h * N + i) * D + d] = acc / l; }
    }
}

static double run(int B, int H, int Hkv, int N, int D, int causal, int reps, bool check) {
    size_t nq = (size_t)B * H * N * D, nk = (size_t)B * Hkv * N * D;
    std::vector<double> hq(nq), hk(nk), hv(nk), ho(nq), ref(nq);
    srand(1234);
    for (auto *vec : {&hq, &hk, &hv}) for (auto &x : *vec) x = 4.0 * rand() / RAND_MAX - 2.0;
    double *q, *k, *v, *o, *lse;
    cudaMalloc(&q, nq * 8); cudaMalloc(&k, nk * 8); cudaMalloc(&v, nk * 8); cudaMalloc(&o, nq * 8);
    cudaMalloc(&lse, (size_t)B * H * N * 8);
    cudaMemcpy(q, hq.data(), nq * 8, cudaMemcpyHostToDevice); cudaMemcpy(k, hk.data(), nk * 8, cudaMemcpyHostToDevice);
    cudaMemcpy(v, hv.data(), nk * 8, cudaMemcpyHostToDevice);
    fadev_attention_params p = {};
    p.batch = B, p.heads = H, p.heads_kv = Hkv, p.seq_q = N, p.seq_kv = N, p.dim = D, p.scale = 1.0 / sqrt((double)D);
    p.causal = causal;
    if (fadev_cuda_golden_attention(q, k, v, o, lse, &p) != FADEV_OK) { printf("FAILED\n"); exit(1); }
    double rel = 0;
    if (check) {
        cudaMemcpy(ho.data(), o, nq * 8, cudaMemcpyDeviceToHost);
        reference(hq, hk, hv, ref, B * H, B * Hkv, N, D, causal, p.scale);
        double num = 0, den = 0;
        for (size_t i = 0; i < nq; i++) { num = fmax(num, fabs(ho[i] - ref[i])); den = fmax(den, fabs(ref[i])); }
        rel = num / den;
    }
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    float best = 1e30f;
    for (int r = 0; r < reps; r++) {
        cudaEventRecord(e0);
        for (int it = 0; it < 5; it++) fadev_cuda_golden_attention(q, k, v, o, lse, &p);
        cudaEventRecord(e1); cudaEventSynchronize(e1);
        float ms; cudaEventElapsedTime(&ms, e0, e1); ms /= 5; if (ms < best) best = ms;
    }
    double flops = 4.0 * B * H * (double)N * N * D * (causal ? 0.5 : 1.0);
    double tf = flops / (best * 1e-3) / 1e12;
    printf("B%d H%d/%d N%d D%d causal%d: %.3f ms  %.2f TFLOP/s%s", B, H, Hkv, N, D, causal, best, tf, check ? "" : "\n");
    if (check) printf("  rel err %.2e\n", rel);
    cudaFree(q); cudaFree(k); cudaFree(v); cudaFree(o); cudaFree(lse);
    return tf;
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 5;
    if (argc > 2) { // profile mode: one shape
        run(1, 16, 16, 4096, atoi(argv[2]), 0, 1, false); return 0; }
    // fp64 matrix rate in the same run
#ifdef HAVE_CUBLAS
    {
        int n = 8192; double *a, *b, *c; cudaMalloc(&a, (size_t)n * n * 8); cudaMalloc(&b, (size_t)n * n * 8); cudaMalloc(&c, (size_t)n * n * 8);
        cudaMemset(a, 0, (size_t)n*n*8); cudaMemset(b, 0, (size_t)n*n*8);
        cublasHandle_t hdl; cublasCreate(&hdl); double one = 1, zero = 0;
        cublasDgemm(hdl, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a, n, b, n, &zero, c, n);
        cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1); float best = 1e30f;
        for (int r = 0; r < 3; r++) { cudaEventRecord(e0); cublasDgemm(hdl, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a, n, b, n, &zero, c, n);
            cudaEventRecord(e1); cudaEventSynchronize(e1); float ms; cudaEventElapsedTime(&ms, e0, e1); if (ms < best) best = ms; }
        printf("cuBLAS DGEMM 8192: %.2f TFLOP/s\n", 2.0 * n * (double)n * n / (best * 1e-3) / 1e12);
        cudaFree(a); cudaFree(b); cudaFree(c);
    }
#endif
    for (int d : {64, 128}) for (int c : {0, 1}) run(1, 2, 1, 512, d, c, 1, true);
    run(1, 1, 1, 333, 40, 1, 1, true);
    for (int d : {64, 128}) for (int c : {0, 1}) run(1, 16, 16, 4096, d, c, reps, false);
    run(1, 4, 4, 16384, 64, 0, reps, false);
    run(1, 4, 4, 16384, 128, 0, reps, false);
    return 0;
}
