#include "megakernel_module.h"

#include <fstream>
#include <sstream>

namespace trtllm_mk {

CudaError::CudaError(const std::string& what, CUresult code) : std::runtime_error(what), code_(code) {}

void check_cu(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  const char* name = nullptr;
  const char* desc = nullptr;
  cuGetErrorName(r, &name);
  cuGetErrorString(r, &desc);
  std::ostringstream os;
  os << what << " failed: " << (name ? name : "CUDA_ERROR_?") << " (" << (desc ? desc : "no description") << ")";
  throw CudaError(os.str(), r);
}

static std::vector<char> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open cubin " + path);
  return std::vector<char>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

MegakernelModule::MegakernelModule(const std::string& cubin_path, const std::string& kernel_name,
                                   const LaunchConfig& cfg, int device)
    : cfg_(cfg) {
  check_cu(cuInit(0), "cuInit");
  CUdevice dev;
  check_cu(cuDeviceGet(&dev, device), "cuDeviceGet");
  CUcontext cur = nullptr;
  check_cu(cuCtxGetCurrent(&cur), "cuCtxGetCurrent");
  if (cur == nullptr) {
    check_cu(cuDevicePrimaryCtxRetain(&ctx_, dev), "cuDevicePrimaryCtxRetain");
    check_cu(cuCtxSetCurrent(ctx_), "cuCtxSetCurrent");
  }
  std::vector<char> image = read_file(cubin_path);
  CUresult r = cuModuleLoadData(&module_, image.data());
  if (r == CUDA_ERROR_NO_BINARY_FOR_GPU || r == CUDA_ERROR_INVALID_IMAGE || r == CUDA_ERROR_INVALID_PTX) {
    int major = 0, minor = 0;
    cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
    cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
    std::ostringstream os;
    os << "cubin " << cubin_path << " cannot run on this GPU (sm_" << major << minor
       << "): it was built for another target or is corrupted";
    throw CudaError(os.str(), r);
  }
  check_cu(r, "cuModuleLoadData");
  check_cu(cuModuleGetFunction(&func_, module_, kernel_name.c_str()), "cuModuleGetFunction");
  check_cu(cuFuncSetAttribute(func_, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, cfg_.smem_bytes),
           "cuFuncSetAttribute(max dynamic shared memory)");
  check_cu(cuDeviceGetAttribute(&sm_count_, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev), "cuDeviceGetAttribute");
  check_cu(cuOccupancyMaxActiveBlocksPerMultiprocessor(&max_active_, func_, cfg_.block, cfg_.smem_bytes),
           "cuOccupancyMaxActiveBlocksPerMultiprocessor");
  // A persistent kernel whose CTAs are not all resident deadlocks on its own events: refuse here.
  if (max_active_ < 1 || (long)max_active_ * sm_count_ < cfg_.grid) {
    std::ostringstream os;
    os << "megakernel needs " << cfg_.grid << " co-resident CTAs (" << cfg_.block << " threads, " << cfg_.smem_bytes
       << " B shared memory) but this GPU fits " << max_active_ << " per SM on " << sm_count_
       << " SMs; build the engine for this GPU";
    throw CudaError(os.str(), CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE);
  }
}

MegakernelModule::~MegakernelModule() {
  if (module_) cuModuleUnload(module_);
  if (ctx_) {
    CUdevice dev;
    if (cuCtxGetDevice(&dev) == CUDA_SUCCESS) cuDevicePrimaryCtxRelease(dev);
  }
}

void MegakernelModule::launch(const void* params, size_t size, CUstream stream) const {
  (void)size;
  void* args[] = {const_cast<void*>(params)};
  CUlaunchAttribute attr;
  attr.id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
  attr.value.cooperative = cfg_.cooperative ? 1 : 0;
  CUlaunchConfig lc = {};
  lc.gridDimX = cfg_.grid;
  lc.gridDimY = lc.gridDimZ = 1;
  lc.blockDimX = cfg_.block;
  lc.blockDimY = lc.blockDimZ = 1;
  lc.sharedMemBytes = cfg_.smem_bytes;
  lc.hStream = stream;
  lc.attrs = &attr;
  lc.numAttrs = 1;
  check_cu(cuLaunchKernelEx(&lc, func_, args, nullptr), "megakernel launch (cuLaunchKernelEx)");
}

}  // namespace trtllm_mk
