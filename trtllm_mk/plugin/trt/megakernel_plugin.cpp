// TensorRT IPluginV3 running one megakernel decode step (interface and I/O: megakernel_plugin.h).
//
// Why the plugin owns device state instead of using TensorRT's workspace: the megakernel's event
// counters are monotonic across steps (a consumer waits for count x (step + 1), and the step number
// itself lives in the control block), so they must persist from one enqueue to the next. Workspace
// memory is only valid during a single enqueue. The state therefore belongs to the plugin clone of
// one execution context (attachToContext) and lives as long as that context.
//
// Why a pinned staging table: the kernel reads each layer's weight pointers from a device array of
// mk::LayerWeights. TensorRT may hand different input addresses to different enqueues, so the table
// is rebuilt on the host from the input pointers every enqueue and, when it differs from the ones
// already on the device, copied with cuMemcpyHtoDAsync from page-locked memory. A pinned source is
// what makes the copy legal inside CUDA-graph capture (the graph's memcpy node reads that host
// memory at replay), and staging slots are never rewritten while a captured or in-flight copy may
// still read them (see DecodeState::select_slot).
//
// Why kv_pool is written although it is an input: the step appends this token's K/V to the paged
// cache in place, as TensorRT-LLM's attention plugin does with its KV pool. TensorRT does not copy a
// network input, so binding kv_pool to the cache memory (setTensorAddress) makes the write land in
// the cache. The input must be a network input bound that way, and no other layer may read it in the
// same engine (TensorRT treats plugin inputs as read-only and would not order such a read).
#include "megakernel_plugin.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>

namespace trtllm_mk {
namespace trt {

using nvinfer1::DataType;
using nvinfer1::Dims;
using nvinfer1::ILogger;
using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;
using nvinfer1::TensorRTPhase;
using Severity = nvinfer1::ILogger::Severity;

namespace {

// ------------------------------------------------------------------------------------- logging

std::mutex g_logger_mutex;
nvinfer1::ILoggerFinder* g_logger_finder = nullptr;

// Reports through the logger of the TensorRT object that called us (ILoggerFinder), so messages
// appear where the application prints TensorRT's own; stderr only when loaded without a finder.
void log(Severity severity, const std::string& msg) noexcept {
  try {
    const std::string line = std::string(kPluginName) + ": " + msg;
    ILogger* logger = nullptr;
    {
      std::lock_guard<std::mutex> lock(g_logger_mutex);
      if (g_logger_finder != nullptr) logger = g_logger_finder->findLogger();
    }
    if (logger != nullptr) {
      logger->log(severity, line.c_str());
    } else if (severity <= Severity::kWARNING) {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
  } catch (...) {
    // Logging must never turn an error report into a crash.
  }
}

const char* dtype_name(DataType t) {
  switch (t) {
    case DataType::kFLOAT: return "float32";
    case DataType::kHALF: return "float16";
    case DataType::kINT8: return "int8";
    case DataType::kINT32: return "int32";
    case DataType::kBOOL: return "bool";
    case DataType::kUINT8: return "uint8";
    case DataType::kBF16: return "bfloat16";
    case DataType::kINT64: return "int64";
    default: return "another dtype";
  }
}

std::string dims_str(const Dims& d) {
  std::ostringstream os;
  os << "[";
  for (int32_t i = 0; i < d.nbDims; ++i) os << (i ? ", " : "") << d.d[i];
  os << "]";
  return os.str();
}

int64_t volume(const Dims& d) {
  int64_t v = 1;
  for (int32_t i = 0; i < d.nbDims; ++i) v *= d.d[i];
  return v;
}

// Dimension constraints beyond an exact size.
constexpr int64_t kAnyPositive = -1;   // kv_pool's num_blocks
constexpr int64_t kAtLeastNeed = -2;   // block_table's max_blocks: at least ceil(history_len / TPB)

struct Expect {
  std::string name;
  DataType type;
  std::vector<int64_t> dims;
  bool optional;  // may be a 1-element placeholder
};

// A switch over a generated enum (seam_generated.h) must name every enumerator: a field or input added
// to trtllm_mk/seam.py then stops the plugin from compiling until it is handled here.
#pragma GCC diagnostic push
#pragma GCC diagnostic error "-Wswitch"

// dtype and shape of fixed input `i`.
Expect fixed_input(InputIndex i, const KernelSpec& k) {
  const KernelDims& d = k.dims;
  const int64_t B = k.batch;
  const std::string name = seam::kFixedInputNames[i];
  switch (i) {
    case kTokens: return {name, DataType::kINT32, {B}, false};
    case kPos: return {name, DataType::kINT32, {B}, false};
    case kKvPool: return {name, DataType::kBF16, {d.L, kAnyPositive, 2, d.NKV, k.tokens_per_block, d.D}, false};
    case kBlockTable: return {name, DataType::kINT32, {B, kAtLeastNeed}, false};
    case kEmbed: return {name, DataType::kBF16, {d.V, d.H}, false};
    case kFinalNorm: return {name, DataType::kBF16, {d.H}, false};
    case kLmHead: return {name, DataType::kBF16, {d.V, d.H}, false};
    case kInvFreq: return {name, DataType::kFLOAT, {d.D / 2}, false};
  }
  throw std::logic_error("unknown plugin input " + std::to_string(static_cast<int>(i)));
}

#pragma GCC diagnostic pop

std::vector<Expect> expectations(const KernelSpec& k) {
  std::vector<Expect> e;
  for (int i = 0; i < kNumFixedInputs; ++i) e.push_back(fixed_input(static_cast<InputIndex>(i), k));
  const std::vector<std::vector<int64_t>> shapes = seam::layer_weight_shapes(k.dims);
  for (int64_t l = 0; l < k.dims.L; ++l)
    for (int f = 0; f < kLayerFields; ++f)
      e.push_back({"layer " + std::to_string(l) + " " + seam::kLayerFieldNames[f] + " (" +
                       seam::kLayerFieldHfSuffixes[f] + ")",
                   DataType::kBF16, shapes[f], seam::kLayerFieldOptional[f]});
  return e;
}

// "8 + 14 per layer": the plugin's input count, in words.
std::string input_count_rule() {
  return std::to_string(kNumFixedInputs) + " + " + std::to_string(kLayerFields) + " per layer";
}

// Why nbInputs / nbOutputs do not fit the engine, or "" when they do.
std::string io_count_error(const KernelSpec& k, int32_t nbInputs, int32_t nbOutputs) {
  if (nbOutputs == kNumOutputs && nbInputs == expected_num_inputs(k)) return "";
  return "got " + std::to_string(nbInputs) + " inputs / " + std::to_string(nbOutputs) + " outputs; the engine needs " +
         std::to_string(expected_num_inputs(k)) + " inputs (" + input_count_rule() + ") and " +
         std::to_string(kNumOutputs) + " outputs";
}

std::string field_string(const PluginField& f) {
  if (f.type != PluginFieldType::kCHAR && f.type != PluginFieldType::kINT8 && f.type != PluginFieldType::kUNKNOWN)
    throw std::runtime_error(std::string("field ") + f.name + " must be a string (PluginFieldType.CHAR)");
  if (f.length < 0 || (f.length > 0 && f.data == nullptr))
    throw std::runtime_error(std::string("field ") + f.name + " has no data");
  std::string s(static_cast<const char*>(f.data), static_cast<size_t>(f.length));
  while (!s.empty() && s.back() == '\0') s.pop_back();  // callers may or may not pass the terminator
  if (s.find('\0') != std::string::npos) throw std::runtime_error(std::string("field ") + f.name + " contains a NUL byte");
  return s;
}

std::string join_path(const std::string& dir, const char* file) {
  if (dir.empty() || dir.back() == '/') return dir + file;
  return dir + "/" + file;
}

void check(CUresult r, const char* what) { check_cu(r, what); }


}  // namespace

// ---------------------------------------------------------------------------------- device state

class DecodeState {
 public:
  static constexpr int kSlots = 8;  // distinct weight-binding tables kept on host and device

  DecodeState(const KernelSpec& k, const std::string& engine_dir) : table_words_(kLayerFields * k.dims.L) {
    try {
      init(k, engine_dir);
    } catch (...) {
      release();
      throw;
    }
  }
  ~DecodeState() { release(); }

  // The slot whose table equals `table`, filling a free (or the least recently used) one if none
  // does; -1 with `err` set when it cannot be done safely.
  int select_slot(const uint64_t* table, bool capturing, std::string& err) {
    const size_t bytes = table_bytes();
    ++clock_;
    for (int s = 0; s < kSlots; ++s) {
      if (slots_[s].used && std::memcmp(host_slot(s), table, bytes) == 0) {
        slots_[s].last_use = clock_;
        return s;
      }
    }
    int victim = -1;
    for (int s = 0; s < kSlots && victim < 0; ++s)
      if (!slots_[s].used) victim = s;
    if (victim < 0) {
      // Reusing a slot rewrites host memory that a captured graph's memcpy node may read at replay,
      // and device memory an in-flight step may read: only outside capture, after that step.
      if (capturing) {
        err = "more than 8 different sets of weight addresses were bound to this execution context; under "
              "CUDA-graph capture a staging table cannot be recycled (bind stable weight addresses)";
        return -1;
      }
      victim = 0;
      for (int s = 1; s < kSlots; ++s)
        if (slots_[s].last_use < slots_[victim].last_use) victim = s;
      if (slots_[victim].kernel_recorded) check(cuEventSynchronize(slots_[victim].last_kernel), "cuEventSynchronize");
    }
    Slot& slot = slots_[victim];
    std::memcpy(host_slot(victim), table, bytes);
    slot.used = true;
    slot.filled = false;
    slot.kernel_recorded = false;
    slot.last_use = clock_;
    return victim;
  }

  // Makes the device copy of slot `s` current on `stream` (see the file comment).
  void upload_slot(int s, CUstream stream, bool capturing) {
    Slot& slot = slots_[s];
    // Inside capture the copy is always part of the graph, so a replay never depends on an eager
    // copy; outside, one copy per slot and stream suffices (same-stream order covers the kernel).
    if (!capturing && slot.filled && slot.filled_stream == stream) return;
    check(cuMemcpyHtoDAsync(device_slot(s), host_slot(s), table_bytes(), stream),
          "cuMemcpyHtoDAsync(layer weight table)");
    if (!capturing) {
      slot.filled = true;
      slot.filled_stream = stream;
    }
  }

  void record_kernel(int s, CUstream stream) {
    check(cuEventRecord(slots_[s].last_kernel, stream), "cuEventRecord");
    slots_[s].kernel_recorded = true;
  }

  uint64_t* scratch_table() { return scratch_.data(); }
  CUdeviceptr device_slot(int s) const { return tables_ + static_cast<CUdeviceptr>(s) * table_bytes(); }

  // Non-empty once a kernel recorded a device-side error (ErrorInfo, named by kernel.json).
  std::string device_error(const KernelSpec& k) const {
    const volatile uint32_t* e = error_host_;
    if (e == nullptr || e[0] == 0) return "";
    const ParamsLayout& L = k.params;
    // Word indices by name from kernel.json; the names are the seam's (seam_generated.h).
    auto word = [&](seam::ErrorField f) -> uint32_t {
      const int i = L.error_word(seam::name(f));
      return i < 0 ? 0u : e[i];
    };
    using EF = seam::ErrorField;
    std::ostringstream os;
    const int64_t code = e[0];
    if (code == L.error_code(seam::name(seam::ErrorCode::NONFINITE_LOGITS))) {
      os << "the logits of batch row " << word(EF::layer) << " were all NaN or -inf at step " << word(EF::task)
         << " (the weights or the KV cache hold non-finite values)";
    } else if (code == L.error_code(seam::name(seam::ErrorCode::WAIT_TIMEOUT))) {
      os << "the megakernel trapped in an earlier step: SM " << word(EF::sm) << " timed out waiting on event "
         << k.event_name(word(EF::event_index)) << " (counter " << word(EF::event_index) << "): target " << word(EF::target)
         << ", seen " << word(EF::seen) << ", layer " << static_cast<int32_t>(word(EF::layer)) << ", task #"
         << word(EF::task)
         << " of that SM. The CUDA context is lost; a schedule that cannot make progress is a build bug "
            "(run `verify` on the engine)";
    } else {
      os << "the megakernel reported device error code " << code;
    }
    return os.str();
  }

  std::unique_ptr<MegakernelModule> module;
  CUdeviceptr x = 0, qkv = 0, part_o = 0, part_ml = 0, attn_out = 0, act = 0, lm_val = 0, lm_idx = 0, pos = 0,
              history = 0, counters = 0, control = 0, error_dev = 0, sampling = 0, lm_lse = 0, logprobs = 0,
              top_ids = 0, cand_hist = 0;

 private:
  struct Slot {
    bool used = false;
    bool filled = false;          // device copy done outside capture on filled_stream
    CUstream filled_stream = nullptr;
    uint64_t last_use = 0;
    CUevent last_kernel = nullptr;  // recorded after each eager step that read this slot
    bool kernel_recorded = false;
  };

  size_t table_bytes() const { return table_words_ * sizeof(uint64_t); }
  uint64_t* host_slot(int s) const { return staging_ + static_cast<size_t>(s) * table_words_; }

  void init(const KernelSpec& k, const std::string& engine_dir) {
    check(cuCtxGetCurrent(&ctx_), "cuCtxGetCurrent");
    if (ctx_ == nullptr) throw std::runtime_error("no CUDA context is current on this thread");
    CUdevice dev;
    check(cuCtxGetDevice(&dev), "cuCtxGetDevice");
    int ordinal = -1, count = 0;
    check(cuDeviceGetCount(&count), "cuDeviceGetCount");
    for (int i = 0; i < count && ordinal < 0; ++i) {
      CUdevice d;
      check(cuDeviceGet(&d, i), "cuDeviceGet");
      if (d == dev) ordinal = i;
    }
    if (ordinal < 0) throw std::runtime_error("cannot find the ordinal of the current CUDA device");
    check_target(k, dev);

    LaunchConfig cfg;
    cfg.grid = static_cast<int>(k.grid);
    cfg.block = static_cast<int>(k.block);
    cfg.smem_bytes = static_cast<int>(k.smem_bytes);
    cfg.cooperative = true;  // the driver refuses a grid that cannot be co-resident instead of hanging
    module = std::make_unique<MegakernelModule>(join_path(engine_dir, "megakernel.cubin"), k.kernel, cfg, ordinal);

    // One arena for every activation buffer; sizes as DecodeBuffers.allocate in runtime/megakernel.py.
    const KernelDims& d = k.dims;
    const size_t B = static_cast<size_t>(k.batch), S = static_cast<size_t>(k.attn_splits);
    size_t offset = 0;
    auto take = [&offset](size_t bytes) {
      const size_t at = offset;
      offset += (bytes + 255) / 256 * 256;  // 256-B alignment: vector loads and bulk copies need >= 16 B
      return at;
    };
    const size_t o_x = take(B * d.H * 8) /* int64 fixed-point residual */, o_qkv = take(B * d.QKVR * 8) /* tagged words */,
                 o_part_o = take(B * d.NKV * S * d.G * d.D * 4), o_part_ml = take(B * d.NKV * S * d.G * 2 * 4),
                 o_attn = take(B * d.NH * d.D * 4), o_act = take(B * d.I * 4) /* tagged bf16 words */, o_lm_val = take(B * k.n_lm_tiles * 4),
                 o_lm_idx = take(B * k.n_lm_tiles * 4), o_pos = take(B * 4), o_hist = take(B * k.history_len * 4),
                 o_ctr = take(static_cast<size_t>(k.num_counters) * 4), o_ctl = take(4 * 4),
                 o_tab = take(kSlots * table_bytes());
    // sampling: all-zero slots, so every row is greedy (TensorRT callers get the kernel's argmax)
    const size_t o_samp = take(B * static_cast<size_t>(k.params.sampling_slot_bytes)),
                 o_lse = take(B * k.n_lm_tiles * 4 * 4),
                 o_lp = take(B * (1 + static_cast<size_t>(k.params.max_top_logprobs)) * 4),
                 o_top = take(B * static_cast<size_t>(k.params.max_top_logprobs) * 4),
                 o_hist_c = take(B * static_cast<size_t>(k.params.cand_hist_bins) * 4);
    check(cuMemAlloc(&arena_, offset), "cuMemAlloc(megakernel state)");
    x = arena_ + o_x;
    qkv = arena_ + o_qkv;
    part_o = arena_ + o_part_o;
    part_ml = arena_ + o_part_ml;
    attn_out = arena_ + o_attn;
    act = arena_ + o_act;
    lm_val = arena_ + o_lm_val;
    lm_idx = arena_ + o_lm_idx;
    pos = arena_ + o_pos;
    sampling = arena_ + o_samp;
    lm_lse = arena_ + o_lse;
    logprobs = arena_ + o_lp;
    top_ids = arena_ + o_top;
    cand_hist = arena_ + o_hist_c;
    history = arena_ + o_hist;
    counters = arena_ + o_ctr;
    control = arena_ + o_ctl;
    tables_ = arena_ + o_tab;
    // Counters and the step number start at zero once and then only grow (no reset between steps).
    check(cuMemsetD8(arena_, 0, offset), "cuMemsetD8(megakernel state)");
    check(cuMemsetD32(history, 0xFFFFFFFFu, B * k.history_len), "cuMemsetD32(history)");
    // Those memsets ran on the legacy stream; TensorRT's stream may be non-blocking, so finish them
    // here (once, outside any capture) rather than race the first step.
    check(cuStreamSynchronize(CU_STREAM_LEGACY), "cuStreamSynchronize(memsets)");

    // Error info in mapped pinned memory: still readable on the host after a trap killed the context.
    void* host = nullptr;
    const size_t error_bytes = k.params.error_fields.size() * sizeof(uint32_t);
    check(cuMemHostAlloc(&host, error_bytes, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE),
          "cuMemHostAlloc(error info)");
    error_host_ = static_cast<uint32_t*>(host);
    std::memset(error_host_, 0, error_bytes);
    check(cuMemHostGetDevicePointer(&error_dev, host, 0), "cuMemHostGetDevicePointer(error info)");

    check(cuMemHostAlloc(&host, kSlots * table_bytes(), CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc(weight tables)");
    staging_ = static_cast<uint64_t*>(host);
    for (Slot& s : slots_) check(cuEventCreate(&s.last_kernel, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    scratch_.assign(table_words_, 0);
  }

  // sm_XY[a]: the cubin holds SASS for exactly that architecture family; say so before the driver
  // answers with a bare CUDA_ERROR_NO_BINARY_FOR_GPU.
  static void check_target(const KernelSpec& k, CUdevice dev) {
    int major = 0, minor = 0;
    check(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cuDeviceGetAttribute");
    check(cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cuDeviceGetAttribute");
    const std::string& t = k.target;
    if (t.size() < 5 || t.compare(0, 3, "sm_") != 0) return;  // unknown spelling: let the driver decide
    const int tv = std::atoi(t.c_str() + 3);
    const bool arch_specific = t.back() == 'a';
    const int have = major * 10 + minor;
    if ((arch_specific && have != tv) || have / 10 != tv / 10 || have < tv) {
      std::ostringstream os;
      os << "the engine's megakernel was compiled for " << t << " but this GPU is sm_" << major << minor
         << "; build the engine for this GPU";
      throw std::runtime_error(os.str());
    }
  }

  void release() noexcept {
    if (ctx_ == nullptr) return;
    // Calls below need the state's context; it may already be gone at process exit (errors ignored).
    if (cuCtxPushCurrent(ctx_) != CUDA_SUCCESS) return;
    module.reset();
    for (Slot& s : slots_)
      if (s.last_kernel != nullptr) cuEventDestroy(s.last_kernel);
    if (arena_ != 0) cuMemFree(arena_);
    if (error_host_ != nullptr) cuMemFreeHost(error_host_);
    if (staging_ != nullptr) cuMemFreeHost(staging_);
    arena_ = 0;
    error_host_ = nullptr;
    staging_ = nullptr;
    CUcontext popped;
    cuCtxPopCurrent(&popped);
    ctx_ = nullptr;
  }

  CUcontext ctx_ = nullptr;
  CUdeviceptr arena_ = 0, tables_ = 0;
  uint32_t* error_host_ = nullptr;
  uint64_t* staging_ = nullptr;
  size_t table_words_;
  Slot slots_[kSlots];
  uint64_t clock_ = 0;
  std::vector<uint64_t> scratch_;
};

// ---------------------------------------------------------------------------------------- plugin

DecodeStepPlugin::DecodeStepPlugin(std::string engine_dir, std::string kernel_json_text, KernelSpec spec,
                                   TensorRTPhase phase)
    : engine_dir_(std::move(engine_dir)),
      kernel_json_text_(std::move(kernel_json_text)),
      spec_(std::move(spec)),
      layer_order_(layer_table_inputs(spec_)),
      phase_(phase) {}

DecodeStepPlugin::~DecodeStepPlugin() = default;

nvinfer1::IPluginCapability* DecodeStepPlugin::getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept {
  switch (type) {
    case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
    case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
    case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
  }
  return nullptr;
}

// A clone shares configuration, never device state: each execution context steps its own counters.
nvinfer1::IPluginV3* DecodeStepPlugin::clone() noexcept {
  try {
    return new DecodeStepPlugin(engine_dir_, kernel_json_text_, spec_, phase_);
  } catch (const std::exception& e) {
    log(Severity::kERROR, std::string("clone failed: ") + e.what());
    return nullptr;
  }
}

std::string DecodeStepPlugin::check_io(const Dims* in_dims, const DataType* in_types, int32_t nbInputs,
                                       const Dims* min_dims, const Dims* max_dims, int32_t nbOutputs) const {
  const std::vector<Expect> expect = expectations(spec_);
  std::ostringstream err;
  if (nbInputs != static_cast<int32_t>(expect.size())) {
    err << "got " << nbInputs << " inputs but the engine in " << engine_dir_ << " needs " << expect.size()
        << " (" << input_count_rule() << " for " << spec_.dims.L << " layers)";
    return err.str();
  }
  if (nbOutputs != kNumOutputs) {
    err << "got " << nbOutputs << " outputs, expected " << kNumOutputs << " (";
    for (int o = 0; o < kNumOutputs; ++o) err << (o ? ", " : "") << seam::kOutputNames[o];
    err << ")";
    return err.str();
  }
  const int64_t need_blocks = (spec_.history_len + spec_.tokens_per_block - 1) / spec_.tokens_per_block;
  std::vector<bool> placeholder(nbInputs, false);
  for (int32_t i = 0; i < nbInputs; ++i) {
    const Expect& e = expect[i];
    const Dims& d = in_dims[i];
    const std::string what = "input " + std::to_string(i) + " (" + e.name + ")";
    if (in_types != nullptr && in_types[i] != e.type)
      return what + ": dtype " + dtype_name(in_types[i]) + " but the engine needs " + dtype_name(e.type);
    bool known = true;
    for (int32_t j = 0; j < d.nbDims; ++j) known = known && d.d[j] >= 0;
    if (e.optional && known && volume(d) == 1) {  // a placeholder for a weight this model does not have
      placeholder[i] = true;
      continue;
    }
    std::ostringstream want;
    want << "[";
    for (size_t j = 0; j < e.dims.size(); ++j)
      want << (j ? ", " : "") << (e.dims[j] == kAnyPositive ? "num_blocks" :
                                  e.dims[j] == kAtLeastNeed ? ">=" + std::to_string(need_blocks) :
                                  std::to_string(e.dims[j]));
    want << "]" << (e.optional ? " (or a 1-element placeholder)" : "");
    if (d.nbDims != static_cast<int32_t>(e.dims.size()))
      return what + ": shape " + dims_str(d) + " but the engine needs " + want.str();
    for (int32_t j = 0; j < d.nbDims; ++j) {
      const int64_t want_j = e.dims[j];
      // A wildcard (-1) at build time is judged by its profile bounds, so every shape the engine
      // accepts at run time fits the kernel.
      const bool wildcard = d.d[j] < 0;
      if (wildcard && (min_dims == nullptr || max_dims == nullptr))
        return what + ": shape " + dims_str(d) + " is not fully known at run time";
      const int64_t lo = wildcard ? min_dims[i].d[j] : d.d[j], hi = wildcard ? max_dims[i].d[j] : d.d[j];
      bool ok;
      if (want_j == kAnyPositive) ok = lo >= 1;
      else if (want_j == kAtLeastNeed) ok = lo >= need_blocks;
      else ok = lo == want_j && hi == want_j;
      if (!ok) {
        std::string got = dims_str(d);
        if (wildcard) got += " (profile range " + dims_str(min_dims[i]) + " .. " + dims_str(max_dims[i]) + ")";
        return what + ": shape " + got + " but the engine needs " + want.str();
      }
    }
  }
  // A model either has QK-norm / QKV bias in every layer or in none; the kernel was compiled for one.
  const int64_t L = spec_.dims.L;
  for (int f = 0; f < kLayerFields; ++f) {
    if (!seam::kLayerFieldOptional[f]) continue;
    const bool first = placeholder[kNumFixedInputs + f];
    for (int64_t l = 1; l < L; ++l)
      if (placeholder[kNumFixedInputs + kLayerFields * l + f] != first)
        return std::string("layer ") + std::to_string(l) + " " + seam::kLayerFieldNames[f] +
               (first ? " is a real tensor but layer 0's is a placeholder" : " is a placeholder but layer 0's is not");
  }
  // absent(f): whether optional field f is a placeholder. Layer 0 answers for every layer (the loop above
  // checked that all layers agree).
  auto absent = [&](seam::LayerField f) { return placeholder[kNumFixedInputs + seam::index_of(f)]; };
  using LF = seam::LayerField;
  const bool no_norm = absent(LF::q_norm), no_bias = absent(LF::q_bias);
  if (absent(LF::k_norm) != no_norm) return "q_norm and k_norm must both be given or both be placeholders";
  if (absent(LF::k_bias) != no_bias || absent(LF::v_bias) != no_bias)
    return "q_bias, k_bias and v_bias must all be given or all be placeholders";
  if (spec_.qk_norm == 1 && no_norm) return "the engine's model has QK-norm: pass q_norm/k_norm, not placeholders";
  if (spec_.qk_norm == 0 && !no_norm) return "the engine's model has no QK-norm: pass 1-element placeholders for q_norm/k_norm";
  if (spec_.qkv_bias == 1 && no_bias) return "the engine's model has QKV bias: pass q/k/v_bias, not placeholders";
  if (spec_.qkv_bias == 0 && !no_bias) return "the engine's model has no QKV bias: pass 1-element placeholders for the biases";
  return "";
}

int32_t DecodeStepPlugin::configurePlugin(const nvinfer1::DynamicPluginTensorDesc* in, int32_t nbInputs,
                                          const nvinfer1::DynamicPluginTensorDesc*, int32_t nbOutputs) noexcept {
  try {
    std::vector<Dims> dims(nbInputs), lo(nbInputs), hi(nbInputs);
    std::vector<DataType> types(nbInputs);
    for (int32_t i = 0; i < nbInputs; ++i) {
      dims[i] = in[i].desc.dims;
      lo[i] = in[i].min;
      hi[i] = in[i].max;
      types[i] = in[i].desc.type;
    }
    const std::string err = check_io(dims.data(), types.data(), nbInputs, lo.data(), hi.data(), nbOutputs);
    if (!err.empty()) {
      log(Severity::kERROR, err);
      return -1;
    }
    return 0;
  } catch (const std::exception& e) {
    log(Severity::kERROR, std::string("configurePlugin: ") + e.what());
    return -1;
  }
}

int32_t DecodeStepPlugin::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, const DataType* inputTypes,
                                             int32_t nbInputs) const noexcept {
  if (const std::string err = io_count_error(spec_, nbInputs, nbOutputs); !err.empty()) {
    log(Severity::kERROR, err);
    return -1;
  }
  try {
    const std::vector<Expect> expect = expectations(spec_);
    for (int32_t i = 0; i < nbInputs; ++i) {
      if (inputTypes[i] != expect[i].type) {
        log(Severity::kERROR, "input " + std::to_string(i) + " (" + expect[i].name + "): dtype " +
                                  dtype_name(inputTypes[i]) + " but the engine needs " + dtype_name(expect[i].type));
        return -1;
      }
    }
  } catch (const std::exception& e) {
    log(Severity::kERROR, std::string("getOutputDataTypes: ") + e.what());
    return -1;
  }
  outputTypes[kNextTokens] = DataType::kINT32;
  outputTypes[kLogits] = DataType::kFLOAT;
  return 0;
}

int32_t DecodeStepPlugin::getOutputShapes(const nvinfer1::DimsExprs*, int32_t nbInputs, const nvinfer1::DimsExprs*,
                                          int32_t, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                                          nvinfer1::IExprBuilder& exprBuilder) noexcept {
  if (const std::string err = io_count_error(spec_, nbInputs, nbOutputs); !err.empty()) {
    log(Severity::kERROR, err);
    return -1;
  }
  // Constants, not expressions of the inputs: the kernel exists for exactly this batch and vocabulary.
  outputs[kNextTokens].nbDims = 1;
  outputs[kNextTokens].d[0] = exprBuilder.constant(spec_.batch);
  outputs[kLogits].nbDims = 2;
  outputs[kLogits].d[0] = exprBuilder.constant(spec_.batch);
  outputs[kLogits].d[1] = exprBuilder.constant(spec_.dims.V);
  return 0;
}

bool DecodeStepPlugin::supportsFormatCombination(int32_t pos, const nvinfer1::DynamicPluginTensorDesc* inOut,
                                                 int32_t nbInputs, int32_t nbOutputs) noexcept {
  if (nbInputs != expected_num_inputs(spec_) || nbOutputs != kNumOutputs || pos < 0 || pos >= nbInputs + nbOutputs)
    return false;
  const nvinfer1::PluginTensorDesc& d = inOut[pos].desc;
  if (d.format != nvinfer1::TensorFormat::kLINEAR) return false;
  DataType want;
  if (pos == nbInputs + kNextTokens || pos == kTokens || pos == kPos || pos == kBlockTable) want = DataType::kINT32;
  else if (pos == nbInputs + kLogits || pos == kInvFreq) want = DataType::kFLOAT;
  else want = DataType::kBF16;
  return d.type == want;
}

int32_t DecodeStepPlugin::onShapeChange(const nvinfer1::PluginTensorDesc* in, int32_t nbInputs,
                                        const nvinfer1::PluginTensorDesc*, int32_t nbOutputs) noexcept {
  try {
    std::vector<Dims> dims(nbInputs);
    std::vector<DataType> types(nbInputs);
    for (int32_t i = 0; i < nbInputs; ++i) {
      dims[i] = in[i].dims;
      types[i] = in[i].type;
    }
    const std::string err = check_io(dims.data(), types.data(), nbInputs, nullptr, nullptr, nbOutputs);
    if (!err.empty()) {
      log(Severity::kERROR, err);
      return -1;
    }
    return 0;
  } catch (const std::exception& e) {
    log(Severity::kERROR, std::string("onShapeChange: ") + e.what());
    return -1;
  }
}

bool DecodeStepPlugin::ensure_state(bool may_defer) noexcept {
  if (state_) return true;
  try {
    CUcontext cur = nullptr;
    if (cuInit(0) != CUDA_SUCCESS || cuCtxGetCurrent(&cur) != CUDA_SUCCESS || cur == nullptr) {
      if (may_defer) return true;  // TensorRT makes the context current before enqueue: set up there
      log(Severity::kERROR, "no CUDA context is current; cannot set up the megakernel");
      return false;
    }
    // The engine was built against one kernel.json; a rebuilt engine dir may have other shapes.
    const std::string path = join_path(engine_dir_, "kernel.json");
    if (read_text_file(path, 1 << 20) != kernel_json_text_) {
      log(Severity::kERROR, path + " differs from the kernel.json this TensorRT engine was built with: the "
                                   "engine directory was rebuilt; rebuild the TensorRT engine too");
      return false;
    }
    state_ = std::make_unique<DecodeState>(spec_, engine_dir_);
    return true;
  } catch (const std::exception& e) {
    log(Severity::kERROR, std::string("cannot set up the megakernel from ") + engine_dir_ + ": " + e.what());
    return false;
  }
}

nvinfer1::IPluginV3* DecodeStepPlugin::attachToContext(nvinfer1::IPluginResourceContext*) noexcept {
  std::unique_ptr<DecodeStepPlugin> p;
  try {
    p = std::make_unique<DecodeStepPlugin>(engine_dir_, kernel_json_text_, spec_, phase_);
  } catch (const std::exception& e) {
    log(Severity::kERROR, std::string("attachToContext: ") + e.what());
    return nullptr;
  }
  // Allocate and load the cubin now, outside any CUDA-graph capture, so that a bad engine dir fails
  // context creation with a clear message rather than the first step.
  if (phase_ == TensorRTPhase::kRUNTIME && !p->ensure_state(true)) return nullptr;
  return p.release();
}

int32_t DecodeStepPlugin::enqueue(const nvinfer1::PluginTensorDesc* inputDesc, const nvinfer1::PluginTensorDesc*,
                                  const void* const* inputs, void* const* outputs, void*,
                                  cudaStream_t cuda_stream) noexcept {
  const CUstream stream = reinterpret_cast<CUstream>(cuda_stream);
  const size_t B = static_cast<size_t>(spec_.batch);
  try {
    if (phase_ == TensorRTPhase::kBUILD) {
      // The builder may time plugins on inputs it filled itself: token ids and block tables there are
      // not valid indices, and the kernel trusts them. Produce zeros instead of running it.
      log(Severity::kVERBOSE, "build-phase enqueue (profiling): outputs zeroed, megakernel not launched");
      check(cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(outputs[kNextTokens]), 0, B * 4, stream), "cuMemsetD8Async");
      check(cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(outputs[kLogits]), 0, B * spec_.dims.V * 4, stream),
            "cuMemsetD8Async");
      return 0;
    }
    CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
    check(cuStreamIsCapturing(stream, &capture), "cuStreamIsCapturing");
    const bool capturing = capture != CU_STREAM_CAPTURE_STATUS_NONE;
    if (!state_) {
      if (capturing) {
        log(Severity::kERROR, "first step enqueued under CUDA-graph capture: device state cannot be allocated "
                              "there; run one step eagerly (or create the execution context) before capturing");
        return -1;
      }
      if (!ensure_state(false)) return -1;
    }
    DecodeState& st = *state_;
    const std::string dev_err = st.device_error(spec_);
    if (!dev_err.empty()) {
      log(Severity::kERROR, dev_err);
      return -1;
    }

    // This enqueue's mk::LayerWeights table; placeholders become null pointers (feature absent).
    uint64_t* table = st.scratch_table();
    for (int64_t l = 0; l < spec_.dims.L; ++l) {
      for (int j = 0; j < kLayerFields; ++j) {   // j: position in the kernel's table
        const int f = layer_order_[j];
        const int i = kNumFixedInputs + kLayerFields * static_cast<int>(l) + f;
        const bool absent = seam::kLayerFieldOptional[f] && volume(inputDesc[i].dims) == 1;
        table[kLayerFields * l + j] = absent ? 0 : reinterpret_cast<uint64_t>(inputs[i]);
      }
    }
    std::string err;
    const int slot = st.select_slot(table, capturing, err);
    if (slot < 0) {
      log(Severity::kERROR, err);
      return -1;
    }
    st.upload_slot(slot, stream, capturing);

    // tokens is in/out for the kernel (it reads this step's token, writes the next one), so the
    // input is copied straight into the next_tokens output and the kernel works there; pos is
    // advanced by the kernel, so it goes to the plugin's own copy and the input stays untouched.
    const CUdeviceptr next_tokens = reinterpret_cast<CUdeviceptr>(outputs[kNextTokens]);
    check(cuMemcpyDtoDAsync(next_tokens, reinterpret_cast<CUdeviceptr>(inputs[kTokens]), B * 4, stream),
          "cuMemcpyDtoDAsync(tokens)");
    check(cuMemcpyDtoDAsync(st.pos, reinterpret_cast<CUdeviceptr>(inputs[kPos]), B * 4, stream),
          "cuMemcpyDtoDAsync(pos)");

    auto ptr = [&](int i) { return reinterpret_cast<CUdeviceptr>(inputs[i]); };
    // mk::Params is passed by value, so a captured CUDA graph holds these bytes; only the table behind
    // `layers` is read through a pointer. Offsets and sizes come from kernel.json (trtllm_mk/seam.py);
    // the value of every field of the seam this plugin was built from comes from param_value.
#pragma GCC diagnostic push
#pragma GCC diagnostic error "-Wswitch"   // every seam::Param must be handled (seam_generated.h)
    auto param_value = [&](seam::Param f) -> uint64_t {
      using P = seam::Param;
      switch (f) {
        case P::layers: return st.device_slot(slot);
        case P::embed: return ptr(kEmbed);
        case P::final_norm: return ptr(kFinalNorm);
        case P::lm_head: return ptr(kLmHead);
        case P::inv_freq: return ptr(kInvFreq);
        case P::x: return st.x;
        case P::qkv: return st.qkv;
        case P::part_o: return st.part_o;
        case P::part_ml: return st.part_ml;
        case P::attn_out: return st.attn_out;
        case P::act: return st.act;
        case P::logits: return reinterpret_cast<CUdeviceptr>(outputs[kLogits]);  // written and re-read by the LM head only
        case P::lm_val: return st.lm_val;
        case P::lm_idx: return st.lm_idx;
        case P::tokens: return next_tokens;
        case P::pos: return st.pos;
        case P::history: return st.history;
        case P::kv_pool: return ptr(kKvPool);
        case P::block_table: return ptr(kBlockTable);
        case P::counters: return st.counters;
        case P::control: return st.control;
        case P::error: return st.error_dev;
        case P::num_blocks: return static_cast<uint64_t>(inputDesc[kKvPool].dims.d[1]);
        case P::block_table_stride: return static_cast<uint64_t>(inputDesc[kBlockTable].dims.d[1]);
        case P::trace: return 0;   // the per-task timeline is off inside TensorRT
        case P::sampling: return st.sampling;
        case P::lm_lse: return st.lm_lse;
        case P::logprobs: return st.logprobs;
        case P::top_ids: return st.top_ids;
        case P::cand_hist: return st.cand_hist;
        case P::layer_scales: return 0;   // bf16 weights: no scale words (layer_table_inputs refuses 4-bit engines)
        case P::peers: return 0;          // one GPU: no tensor-parallel peers
        case P::rank: return 0;
        case P::routers:                  // dense models: no experts (mixture-of-experts engines are refused)
        case P::experts:
        case P::router_o:
        case P::router_logits:
        case P::moe_slot:
        case P::moe_w:
        case P::moe_act:
        case P::moe_xn:
        case P::router_acc:
        case P::expert_sum: return 0;
      }
      throw std::logic_error(std::string("no value for mk::Params field ") + seam::name(f));
    };
#pragma GCC diagnostic pop
    const ParamsLayout& L = spec_.params;
    std::vector<unsigned char> p(static_cast<size_t>(L.size), 0);
    for (int i = 0; i < seam::kNumParams; ++i) {
      const auto f = static_cast<seam::Param>(i);
      L.put(p, seam::name(f), param_value(f));
    }
    st.module->launch(p.data(), p.size(), stream);
    if (!capturing) st.record_kernel(slot, stream);
    return 0;
  } catch (const std::exception& e) {
    log(Severity::kERROR, std::string("enqueue: ") + e.what());
    return -1;
  }
}

const PluginFieldCollection* DecodeStepPlugin::getFieldsToSerialize() noexcept {
  // kernel_json travels with the engine so that a later change of the engine dir is detected.
  serialized_fields_.clear();
  serialized_fields_.emplace_back("engine_dir", engine_dir_.c_str(), PluginFieldType::kCHAR,
                                  static_cast<int32_t>(engine_dir_.size()));
  serialized_fields_.emplace_back("kernel_json", kernel_json_text_.c_str(), PluginFieldType::kCHAR,
                                  static_cast<int32_t>(kernel_json_text_.size()));
  serialized_fc_.nbFields = static_cast<int32_t>(serialized_fields_.size());
  serialized_fc_.fields = serialized_fields_.data();
  return &serialized_fc_;
}

// --------------------------------------------------------------------------------------- creator

DecodeStepPluginCreator::DecodeStepPluginCreator() {
  fields_.emplace_back("engine_dir", nullptr, PluginFieldType::kCHAR, 0);
  field_names_.nbFields = static_cast<int32_t>(fields_.size());
  field_names_.fields = fields_.data();
}

nvinfer1::IPluginV3* DecodeStepPluginCreator::createPlugin(const char*, const PluginFieldCollection* fc,
                                                           TensorRTPhase phase) noexcept {
  try {
    std::string engine_dir, kernel_json_text;
    bool have_kernel_json = false;
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {
      const PluginField& f = fc->fields[i];
      const std::string name = f.name != nullptr ? f.name : "";
      if (name == "engine_dir") {
        engine_dir = field_string(f);
      } else if (name == "kernel_json") {
        kernel_json_text = field_string(f);
        have_kernel_json = true;
      } else {
        throw std::runtime_error("unknown plugin field '" + name + "' (the only field is engine_dir)");
      }
    }
    if (engine_dir.empty()) throw std::runtime_error("missing plugin field engine_dir (a trtllm_mk engine directory)");
    // At build time the engine dir is read now; at deserialization the copy from the engine is used
    // (and compared with the engine dir when the context is set up).
    const std::string json_path = join_path(engine_dir, "kernel.json");
    if (phase == TensorRTPhase::kBUILD || !have_kernel_json) kernel_json_text = read_text_file(json_path, 1 << 20);
    KernelSpec spec = parse_kernel_json(kernel_json_text, json_path);
    if (phase == TensorRTPhase::kBUILD) {
      const std::string cubin = join_path(engine_dir, "megakernel.cubin");
      if (std::FILE* f = std::fopen(cubin.c_str(), "rb")) {
        std::fclose(f);
      } else {
        throw std::runtime_error(cubin + " is missing; build the engine (python build_scripts/build_engine.py)");
      }
    }
    return new DecodeStepPlugin(engine_dir, kernel_json_text, std::move(spec), phase);
  } catch (const std::exception& e) {
    log(Severity::kERROR, std::string("createPlugin: ") + e.what());
    return nullptr;
  }
}

}  // namespace trt
}  // namespace trtllm_mk

// ------------------------------------------------------------------------------ library entry points

extern "C" nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  static trtllm_mk::trt::DecodeStepPluginCreator creator;
  static nvinfer1::IPluginCreatorInterface* const creators[] = {&creator};
  nbCreators = 1;
  return creators;
}

extern "C" void setLoggerFinder(nvinfer1::ILoggerFinder* finder) {
  std::lock_guard<std::mutex> lock(trtllm_mk::trt::g_logger_mutex);
  trtllm_mk::trt::g_logger_finder = finder;
}
