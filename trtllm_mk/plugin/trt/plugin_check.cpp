// trt_plugin_check <engine_dir>: loads nothing of TensorRT; calls the plugin library's build-phase
// interface directly, in the order TensorRT's builder would, and checks the answers: creator lookup
// through getCreators(), plugin creation from engine_dir, output types, format support, the input
// checks of configurePlugin (a correct set of inputs and several wrong ones, each refused with a
// message naming the input), and the serialize -> create(RUNTIME) -> clone round trip.
// It cannot check enqueue (that needs a GPU and a TensorRT execution context): a build-phase plugin
// never touches CUDA, which is why this runs on a machine without a GPU driver.
// Exit code 0 when every check passed; messages the plugin logged are printed.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "megakernel_plugin.h"

using namespace nvinfer1;
namespace seam = ::trtllm_mk_seam;

namespace {

// The application side of TensorRT's logging interfaces, as any TensorRT application implements them.
class CapturingLogger : public ILogger {
 public:
  void log(Severity, const char* msg) noexcept override {
    last = msg;
    std::printf("  plugin log: %s\n", msg);
  }
  std::string last;
};

class Finder : public ILoggerFinder {
 public:
  explicit Finder(ILogger* l) : logger_(l) {}
  ILogger* findLogger() override { return logger_; }

 private:
  ILogger* logger_;
};

int g_failures = 0;

void expect(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++g_failures;
}

Dims make_dims(std::vector<int64_t> v) {
  Dims d{};
  d.nbDims = static_cast<int32_t>(v.size());
  for (size_t i = 0; i < v.size(); ++i) d.d[i] = v[i];
  return d;
}

DynamicPluginTensorDesc desc(DataType t, std::vector<int64_t> dims) {
  DynamicPluginTensorDesc d{};
  d.desc.dims = make_dims(dims);
  d.desc.type = t;
  d.desc.format = TensorFormat::kLINEAR;
  d.desc.scale = -1.f;
  d.min = d.max = d.opt = d.desc.dims;
  return d;
}

// A correct set of inputs for the engine's kernel.json (placeholders for QK-norm and biases unless
// the kernel.json says the model has them).
std::vector<DynamicPluginTensorDesc> good_inputs(const trtllm_mk::KernelSpec& k) {
  const auto& d = k.dims;
  const int64_t B = k.batch;
  const int64_t blocks = (k.history_len + k.tokens_per_block - 1) / k.tokens_per_block;
  std::vector<DynamicPluginTensorDesc> in = {
      desc(DataType::kINT32, {B}),
      desc(DataType::kINT32, {B}),
      desc(DataType::kBF16, {d.L, B * blocks, 2, d.NKV, k.tokens_per_block, d.D}),
      desc(DataType::kINT32, {B, blocks}),
      desc(DataType::kBF16, {d.V, d.H}),
      desc(DataType::kBF16, {d.H}),
      desc(DataType::kBF16, {d.V, d.H}),
      desc(DataType::kFLOAT, {d.D / 2}),
  };
  const bool norm = k.qk_norm == 1, bias = k.qkv_bias == 1;
  using LF = seam::LayerField;
  std::vector<std::vector<int64_t>> shapes = seam::layer_weight_shapes(d);
  for (LF f : {LF::q_norm, LF::k_norm})
    if (!norm) shapes[seam::index_of(f)] = {1};
  for (LF f : {LF::q_bias, LF::k_bias, LF::v_bias})
    if (!bias) shapes[seam::index_of(f)] = {1};
  for (int64_t l = 0; l < d.L; ++l)
    for (const auto& s : shapes) in.push_back(desc(DataType::kBF16, s));
  return in;
}

std::vector<DynamicPluginTensorDesc> outputs(const trtllm_mk::KernelSpec& k) {
  return {desc(DataType::kINT32, {k.batch}), desc(DataType::kFLOAT, {k.batch, k.dims.V})};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: trt_plugin_check <engine_dir>\n");
    return 2;
  }
  const std::string engine_dir = argv[1];
  CapturingLogger logger;
  Finder finder(&logger);
  setLoggerFinder(&finder);

  int32_t n = 0;
  IPluginCreatorInterface* const* creators = getCreators(n);
  expect(n == 1 && creators != nullptr, "getCreators returns one creator");
  if (n != 1) return 1;
  auto* creator = static_cast<IPluginCreatorV3One*>(creators[0]);
  expect(std::strcmp(creator->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") == 0, "creator is an IPluginCreatorV3One");
  expect(std::strcmp(creator->getPluginName(), "TrtllmMkDecodeStep") == 0 &&
             std::strcmp(creator->getPluginVersion(), "1") == 0 && std::strcmp(creator->getPluginNamespace(), "") == 0,
         "creator is TrtllmMkDecodeStep / 1 / \"\"");
  const PluginFieldCollection* names = creator->getFieldNames();
  expect(names->nbFields == 1 && std::strcmp(names->fields[0].name, "engine_dir") == 0, "field names: engine_dir");

  PluginFieldCollection empty{};
  expect(creator->createPlugin("mk", &empty, TensorRTPhase::kBUILD) == nullptr &&
             logger.last.find("missing plugin field engine_dir") != std::string::npos,
         "createPlugin without engine_dir is refused");
  const std::string bogus = engine_dir + "/does-not-exist";
  PluginField bogus_field("engine_dir", bogus.c_str(), PluginFieldType::kCHAR, static_cast<int32_t>(bogus.size()));
  PluginFieldCollection bogus_fc{1, &bogus_field};
  expect(creator->createPlugin("mk", &bogus_fc, TensorRTPhase::kBUILD) == nullptr &&
             logger.last.find("kernel.json: cannot open") != std::string::npos,
         "createPlugin with a missing engine dir is refused");

  PluginField field("engine_dir", engine_dir.c_str(), PluginFieldType::kCHAR, static_cast<int32_t>(engine_dir.size() + 1));
  PluginFieldCollection fc{1, &field};
  IPluginV3* plugin = creator->createPlugin("mk", &fc, TensorRTPhase::kBUILD);
  expect(plugin != nullptr, "createPlugin(engine_dir) in the build phase");
  if (plugin == nullptr) return 1;
  auto* core = static_cast<IPluginV3OneCore*>(plugin->getCapabilityInterface(PluginCapabilityType::kCORE));
  auto* build = static_cast<IPluginV3OneBuild*>(plugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
  auto* runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
  expect(core != nullptr && build != nullptr && runtime != nullptr &&
             std::strcmp(core->getPluginName(), "TrtllmMkDecodeStep") == 0,
         "capability interfaces core/build/runtime");
  const auto& spec = static_cast<trtllm_mk::trt::DecodeStepPlugin*>(plugin)->spec();

  std::vector<DynamicPluginTensorDesc> in = good_inputs(spec), out = outputs(spec);
  const int32_t nin = static_cast<int32_t>(in.size());
  expect(build->getNbOutputs() == 2, "two outputs");
  std::vector<DataType> in_types;
  for (const auto& d : in) in_types.push_back(d.desc.type);
  DataType out_types[2];
  expect(build->getOutputDataTypes(out_types, 2, in_types.data(), nin) == 0 && out_types[0] == DataType::kINT32 &&
             out_types[1] == DataType::kFLOAT,
         "output types int32 (next_tokens), float32 (logits)");
  std::vector<DynamicPluginTensorDesc> io = in;
  io.insert(io.end(), out.begin(), out.end());
  bool formats = true;
  for (int32_t pos = 0; pos < nin + 2; ++pos) formats = formats && build->supportsFormatCombination(pos, io.data(), nin, 2);
  io[0].desc.type = DataType::kBF16;
  formats = formats && !build->supportsFormatCombination(0, io.data(), nin, 2);
  expect(formats, "supportsFormatCombination: the expected dtypes only");

  expect(build->configurePlugin(in.data(), nin, out.data(), 2) == 0, "configurePlugin accepts the engine's inputs");
  {
    auto dyn = in;  // num_blocks and block-table width as profile dimensions
    dyn[2].desc.dims.d[1] = -1;
    dyn[2].min.d[1] = 1;
    dyn[2].max.d[1] = 4096;
    expect(build->configurePlugin(dyn.data(), nin, out.data(), 2) == 0, "configurePlugin accepts a dynamic num_blocks");
  }
  {
    auto bad = in;
    bad[2].desc.dims.d[3] += 1;
    bad[2].min = bad[2].max = bad[2].opt = bad[2].desc.dims;
    expect(build->configurePlugin(bad.data(), nin, out.data(), 2) != 0 &&
               logger.last.find("input 2 (kv_pool)") != std::string::npos,
           "configurePlugin refuses a kv_pool with the wrong head count");
  }
  {
    auto bad = in;
    bad[3].desc.dims.d[1] -= 1;
    bad[3].min = bad[3].max = bad[3].opt = bad[3].desc.dims;
    expect(build->configurePlugin(bad.data(), nin, out.data(), 2) != 0 &&
               logger.last.find("input 3 (block_table)") != std::string::npos,
           "configurePlugin refuses a block table too narrow for history_len");
  }
  {
    auto bad = in;
    bad[7].desc.type = DataType::kBF16;
    expect(build->configurePlugin(bad.data(), nin, out.data(), 2) != 0 &&
               logger.last.find("inv_freq): dtype bfloat16") != std::string::npos,
           "configurePlugin refuses a bf16 inv_freq");
  }
  {
    auto bad = in;
    bad.pop_back();
    expect(build->configurePlugin(bad.data(), nin - 1, out.data(), 2) != 0 &&
               logger.last.find("inputs but the engine") != std::string::npos,
           "configurePlugin refuses a missing input");
  }
  if (spec.dims.L >= 2 && spec.qk_norm != 1) {
    auto bad = in;  // layer 1 with a real q_norm while layer 0 has a placeholder
    const int i = seam::kNumFixedInputs + seam::kNumLayerFields + seam::index_of(seam::LayerField::q_norm);
    bad[i] = desc(DataType::kBF16, {spec.dims.D});
    expect(build->configurePlugin(bad.data(), nin, out.data(), 2) != 0 &&
               logger.last.find("layer 1 q_norm") != std::string::npos,
           "configurePlugin refuses QK-norm in some layers only");
  }

  const PluginFieldCollection* ser = runtime->getFieldsToSerialize();
  bool has_dir = false, has_json = false;
  for (int32_t i = 0; i < ser->nbFields; ++i) {
    has_dir = has_dir || std::strcmp(ser->fields[i].name, "engine_dir") == 0;
    has_json = has_json || std::strcmp(ser->fields[i].name, "kernel_json") == 0;
  }
  expect(has_dir && has_json, "serialized fields: engine_dir and kernel_json");
  IPluginV3* restored = creator->createPlugin("mk", ser, TensorRTPhase::kRUNTIME);
  expect(restored != nullptr, "createPlugin(RUNTIME) from the serialized fields");
  IPluginV3* copy = restored != nullptr ? restored->clone() : nullptr;
  expect(copy != nullptr, "clone");
  delete copy;
  delete restored;
  delete plugin;
  setLoggerFinder(nullptr);
  std::printf("%s\n", g_failures == 0 ? "all checks passed" : "SOME CHECKS FAILED");
  return g_failures == 0 ? 0 : 1;
}
