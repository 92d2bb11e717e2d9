// TensorRT face of the megakernel: one decode step as an IPluginV3 ("TrtllmMkDecodeStep", version
// "1", namespace ""). The library exports getCreators() and setLoggerFinder(), so
// trt.get_plugin_registry().load_library(path) loads it; it is linked against the CUDA driver
// (libcuda) only, never against libnvinfer (the TensorRT headers give it every type it needs).
//
// Plugin field:  engine_dir (string)  a trtllm_mk engine directory: megakernel.cubin + kernel.json.
//                The serialized TensorRT engine keeps engine_dir and a copy of kernel.json; the cubin
//                is loaded from engine_dir when an execution context is created, and a kernel.json
//                there that differs from the copy is refused (the engine dir was rebuilt since).
// Inputs (device tensors, linear layout):
//   0 tokens      int32 [B]          this step's token per sequence
//   1 pos         int32 [B]          its position (= tokens already in the cache)
//   2 kv_pool     bf16  [L, num_blocks, 2, NKV, TPB, D]   updated IN PLACE (K/V of this step appended)
//   3 block_table int32 [B, max_blocks]  with max_blocks * TPB >= history_len
//   4 embed bf16 [V, H]   5 final_norm bf16 [H]   6 lm_head bf16 [V, H]   7 inv_freq float [D/2]
//   8 + 14*l + f  layer l's input f in mk::LayerWeights order (q, k, v, o, gate, up, down,
//                 ln1, ln2, q_norm, k_norm, q_bias, k_bias, v_bias); the model's absent ones
//                 (q_norm/k_norm without QK-norm, biases without QKV bias) as 1-element bf16 placeholders
// Outputs: 0 next_tokens int32 [B] (greedy argmax), 1 logits float [B, V].
// B, V and all dims are fixed by kernel.json: the kernel was compiled for exactly that deployment.
// The names, order and counts above (plugin identity, inputs, layer fields and their shapes, the
// mk::Params fields, the kernel.json dims keys) come from seam_generated.h, which the build generates
// from trtllm_mk/seam.py; the numbers in this comment are today's values.
#pragma once

#include <NvInferRuntime.h>
#include <cuda.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernel_json.h"
#include "megakernel_module.h"
#include "seam_generated.h"

namespace trtllm_mk {
namespace trt {

namespace seam = ::trtllm_mk_seam;   // generated from trtllm_mk/seam.py

using seam::kPluginName;
using seam::kPluginNamespace;
using seam::kPluginVersion;

using seam::kNumFixedInputs;
using seam::kNumOutputs;
constexpr int kLayerFields = seam::kNumLayerFields;   // mk::LayerWeights pointers, inputs per layer
using seam::InputIndex;
using seam::OutputIndex;
using seam::kTokens;
using seam::kPos;
using seam::kKvPool;
using seam::kBlockTable;
using seam::kEmbed;
using seam::kFinalNorm;
using seam::kLmHead;
using seam::kInvFreq;
using seam::kNextTokens;
using seam::kLogits;

// The plugin's per-layer input order is seam::kLayerFieldNames (mk::LayerWeights' order in the seam the
// plugin was built from); the kernel's own table order comes from kernel.json (params.layer_fields).
// The plugin fills every mk::Params field of that seam (enqueue() in megakernel_plugin.cpp: a switch
// over seam::Param, so a new field does not compile until the plugin fills it); a kernel.json field
// outside it would be left unset, so such an engine is refused.

// For each entry of the kernel's layer table, the index of the layer input that fills it; throws
// KernelJsonError when the kernel's Params or layer table has an entry the plugin cannot fill.
inline std::vector<int> layer_table_inputs(const KernelSpec& k) {
  if (k.weight_bits != 16)
    throw KernelJsonError("kernel.json: the engine streams " + std::to_string(k.weight_bits) + "-bit weights (W" +
                          std::to_string(k.weight_bits) + "A16); the TensorRT plugin binds bf16 weights only, so "
                          "quantized engines run through the PyTorch runtime (python -m trtllm_mk run / serve)");
  for (const auto& f : k.params.fields) {
    bool known = false;
    for (const char* name : seam::kParamNames) known = known || f.name == name;
    if (!known) throw KernelJsonError("kernel.json: the kernel's Params field \"" + f.name + "\" is unknown to this "
                                      "plugin; rebuild the plugin from the same trtllm_mk as the engine");
  }
  if (k.params.layer_fields.size() != static_cast<size_t>(kLayerFields))
    throw KernelJsonError("kernel.json: the kernel's layer table has " + std::to_string(k.params.layer_fields.size()) +
                          " entries, this plugin binds " + std::to_string(kLayerFields) + " per layer");
  std::vector<int> order;
  for (const auto& name : k.params.layer_fields) {
    int f = 0;
    while (f < kLayerFields && name != seam::kLayerFieldNames[f]) ++f;
    if (f == kLayerFields) throw KernelJsonError("kernel.json: layer table entry \"" + name + "\" is unknown to this plugin");
    order.push_back(f);
  }
  return order;
}

// Number of inputs the engine's kernel.json implies.
inline int expected_num_inputs(const KernelSpec& k) { return kNumFixedInputs + kLayerFields * static_cast<int>(k.dims.L); }

// The persistent device state of one execution context (see megakernel_plugin.cpp).
class DecodeState;

class DecodeStepPlugin : public nvinfer1::IPluginV3,
                         public nvinfer1::IPluginV3OneCore,
                         public nvinfer1::IPluginV3OneBuild,
                         public nvinfer1::IPluginV3OneRuntime {
 public:
  DecodeStepPlugin(std::string engine_dir, std::string kernel_json_text, KernelSpec spec,
                   nvinfer1::TensorRTPhase phase);
  ~DecodeStepPlugin() override;
  DecodeStepPlugin(const DecodeStepPlugin&) = delete;
  DecodeStepPlugin& operator=(const DecodeStepPlugin&) = delete;

  // IPluginV3
  nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
  nvinfer1::IPluginV3* clone() noexcept override;

  // IPluginV3OneCore
  const char* getPluginName() const noexcept override { return kPluginName; }
  const char* getPluginVersion() const noexcept override { return kPluginVersion; }
  const char* getPluginNamespace() const noexcept override { return kPluginNamespace; }

  // IPluginV3OneBuild
  int32_t configurePlugin(const nvinfer1::DynamicPluginTensorDesc* in, int32_t nbInputs,
                          const nvinfer1::DynamicPluginTensorDesc* out, int32_t nbOutputs) noexcept override;
  int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
                             const nvinfer1::DataType* inputTypes, int32_t nbInputs) const noexcept override;
  int32_t getOutputShapes(const nvinfer1::DimsExprs* inputs, int32_t nbInputs, const nvinfer1::DimsExprs* shapeInputs,
                          int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                          nvinfer1::IExprBuilder& exprBuilder) noexcept override;
  bool supportsFormatCombination(int32_t pos, const nvinfer1::DynamicPluginTensorDesc* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override;
  int32_t getNbOutputs() const noexcept override { return kNumOutputs; }
  size_t getWorkspaceSize(const nvinfer1::DynamicPluginTensorDesc*, int32_t, const nvinfer1::DynamicPluginTensorDesc*,
                          int32_t) const noexcept override {
    return 0;  // everything persistent lives in DecodeState: workspace does not survive an enqueue
  }
  const char* getMetadataString() noexcept override { return engine_dir_.c_str(); }

  // IPluginV3OneRuntime
  int32_t onShapeChange(const nvinfer1::PluginTensorDesc* in, int32_t nbInputs, const nvinfer1::PluginTensorDesc* out,
                        int32_t nbOutputs) noexcept override;
  int32_t enqueue(const nvinfer1::PluginTensorDesc* inputDesc, const nvinfer1::PluginTensorDesc* outputDesc,
                  const void* const* inputs, void* const* outputs, void* workspace,
                  cudaStream_t stream) noexcept override;
  nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
  const nvinfer1::PluginFieldCollection* getFieldsToSerialize() noexcept override;

  const KernelSpec& spec() const { return spec_; }

 private:
  // "" when the input/output descriptions fit the engine, else what is wrong (one line).
  std::string check_io(const nvinfer1::Dims* in_dims, const nvinfer1::DataType* in_types, int32_t nbInputs,
                       const nvinfer1::Dims* min_dims, const nvinfer1::Dims* max_dims, int32_t nbOutputs) const;
  bool ensure_state(bool may_defer) noexcept;

  std::string engine_dir_;
  std::string kernel_json_text_;
  KernelSpec spec_;
  std::vector<int> layer_order_;   // layer_table_inputs(spec_)
  nvinfer1::TensorRTPhase phase_;
  std::unique_ptr<DecodeState> state_;
  std::vector<nvinfer1::PluginField> serialized_fields_;
  nvinfer1::PluginFieldCollection serialized_fc_{};
};

class DecodeStepPluginCreator : public nvinfer1::IPluginCreatorV3One {
 public:
  DecodeStepPluginCreator();
  nvinfer1::IPluginV3* createPlugin(const char* name, const nvinfer1::PluginFieldCollection* fc,
                                    nvinfer1::TensorRTPhase phase) noexcept override;
  const nvinfer1::PluginFieldCollection* getFieldNames() noexcept override { return &field_names_; }
  const char* getPluginName() const noexcept override { return kPluginName; }
  const char* getPluginVersion() const noexcept override { return kPluginVersion; }
  const char* getPluginNamespace() const noexcept override { return kPluginNamespace; }

 private:
  std::vector<nvinfer1::PluginField> fields_;
  nvinfer1::PluginFieldCollection field_names_{};
};

}  // namespace trt
}  // namespace trtllm_mk

// Entry points TensorRT's IPluginRegistry::loadLibrary() looks up (no libnvinfer link needed).
extern "C" __attribute__((visibility("default"))) nvinfer1::IPluginCreatorInterface* const* getCreators(
    int32_t& nbCreators);
extern "C" __attribute__((visibility("default"))) void setLoggerFinder(nvinfer1::ILoggerFinder* finder);
