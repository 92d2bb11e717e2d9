// kernel_json_check <engine_dir>/kernel.json: parse a kernel.json exactly as the TensorRT plugin does
// and print what it read, or the error and exit code 1. Needs neither TensorRT nor CUDA, so it
// doubles as the test driver of the reader (tests/test_trt_integration.py builds it with g++).
#include <iostream>

#include "kernel_json.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: kernel_json_check <path/to/kernel.json>\n";
    return 2;
  }
  try {
    const trtllm_mk::KernelSpec k = trtllm_mk::read_kernel_json(argv[1]);
    const trtllm_mk::KernelDims& d = k.dims;
    std::cout << "kernel=" << k.kernel << " target=" << k.target << " grid=" << k.grid << " block=" << k.block
              << " smem_bytes=" << k.smem_bytes << " num_counters=" << k.num_counters
              << " n_lm_tiles=" << k.n_lm_tiles << " history_len=" << k.history_len
              << " tokens_per_block=" << k.tokens_per_block << " batch=" << k.batch
              << " attn_splits=" << k.attn_splits;
#define TRTLLM_MK_PRINT_DIM(key) std::cout << " " #key "=" << d.key;
    TRTLLM_MK_SEAM_KERNEL_DIMS(TRTLLM_MK_PRINT_DIM)
#undef TRTLLM_MK_PRINT_DIM
    std::cout << " events=" << k.event_offsets.size() << " qk_norm=" << k.qk_norm << " qkv_bias=" << k.qkv_bias
              << " weight_bits=" << k.weight_bits
              << " params_size=" << k.params.size << " params_fields=" << k.params.fields.size()
              << " layer_fields=" << k.params.layer_fields.size() << "\n";
    for (const auto& f : k.params.fields) std::cout << "param " << f.name << " " << f.offset << " " << f.size << "\n";
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
