// Host runtime of the megakernel: load a generated cubin, check it fits the device, launch one
// decode step on a stream. CUDA driver API only (no torch), so the same code serves the pybind11
// module, the torch custom op and the TensorRT plugin.
#pragma once
#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace trtllm_mk {

// Every CUDA failure is thrown with the operation that failed and the driver's own name for it.
class CudaError : public std::runtime_error {
 public:
  CudaError(const std::string& what, CUresult code);
  CUresult code() const { return code_; }

 private:
  CUresult code_;
};

void check_cu(CUresult r, const char* what);

struct LaunchConfig {
  int grid = 0;          // CTAs: one per SM, all co-resident
  int block = 0;         // threads per CTA
  int smem_bytes = 0;    // dynamic shared memory per CTA
  bool cooperative = true;  // cooperative launch: the driver refuses rather than under-subscribing
};

class MegakernelModule {
 public:
  // Loads the cubin into the current context of `device` (the primary context when none is current).
  MegakernelModule(const std::string& cubin_path, const std::string& kernel_name, const LaunchConfig& cfg,
                   int device = 0);
  ~MegakernelModule();
  MegakernelModule(const MegakernelModule&) = delete;
  MegakernelModule& operator=(const MegakernelModule&) = delete;

  // One decode step: `params` is the kernel's Params struct, `size` its byte size.
  void launch(const void* params, size_t size, CUstream stream) const;

  int device_sm_count() const { return sm_count_; }
  int max_active_ctas_per_sm() const { return max_active_; }
  const LaunchConfig& config() const { return cfg_; }

 private:
  LaunchConfig cfg_;
  CUmodule module_ = nullptr;
  CUfunction func_ = nullptr;
  CUcontext ctx_ = nullptr;
  int sm_count_ = 0;
  int max_active_ = 0;
};

}  // namespace trtllm_mk
