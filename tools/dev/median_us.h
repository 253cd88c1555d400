// Dev benchmarks' timing: the median of `reps` launches (after `warmup` more) of a kernel launched alone
// on the default stream, in microseconds between CUDA events; a failed launch or kernel ends the process.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

template <typename Launch>
float median_us(Launch launch, int reps = 10, int warmup = 2) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    std::vector<float> us;
    for (int it = 0; it < warmup + reps; ++it) {
        cudaEventRecord(a);
        launch();
        cudaEventRecord(b);
        const cudaError_t e = cudaEventSynchronize(b);
        if (e != cudaSuccess || cudaGetLastError() != cudaSuccess) {
            std::fprintf(stderr, "median_us: the kernel failed: %s\n", cudaGetErrorString(e));
            std::exit(1);
        }
        float ms = 0;
        cudaEventElapsedTime(&ms, a, b);
        if (it >= warmup) us.push_back(ms * 1e3f);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
}
