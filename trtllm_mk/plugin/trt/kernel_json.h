// kernel.json: the launch layout and model dimensions the engine builder writes next to
// megakernel.cubin (trtllm_mk/engine.py: kernel_json()). The TensorRT plugin needs them to check its
// inputs and to size its device state; they are read with the tiny strict reader below because the
// plugin must not depend on a JSON library (none ships with TensorRT, and vendoring one for a
// two-level file is not worth it). No TensorRT or CUDA header is needed here, so the reader is
// tested on its own (trtllm_mk/plugin/trt/kernel_json_check.cpp). The "dims" keys come from
// seam_generated.h, which the build generates from trtllm_mk/seam.py (KERNEL_DIMS).
//
// Accepted schema (all integers are JSON integers: no fraction, no exponent, within int32):
//   required  "kernel"            string, the kernel's entry point (e.g. "mk_decode_step")
//             "grid"              int >= 1   persistent CTAs (one per SM)
//             "block"             int >= 32, a multiple of 32 (threads per CTA)
//             "smem_bytes"        int >= 0   dynamic shared memory per CTA
//             "num_counters"      int >= 1   event counters
//             "n_lm_tiles"        int >= 1   LM-head tiles (first-level argmax)
//             "history_len"       int >= 1   = max_seq_len
//             "tokens_per_block"  int >= 1, a power of two
//             "batch"             int >= 1
//             "attn_splits"       int >= 1
//             "dims"              object {every key of seam KERNEL_DIMS: "L","H","I","V","NH","NKV",
//                                 "D","G","QKVR"}: ints >= 1 with NH == NKV*G, QKVR == NKV*(G+2)*D
//                                 and D even
//             "target"            string, e.g. "sm_90a"
//             "params"            object {"size": sizeof(mk::Params), "fields": [{"name", "offset",
//                                 "size" (4 or 8), ...}], "layer_fields": [mk::LayerWeights member
//                                 names in table order], "error_fields": [mk::ErrorInfo words in
//                                 order], "error_codes": {name: code >= 1}, "sampling_slot_bytes",
//                                 "max_top_logprobs", "cand_hist_bins": ints >= 1} (trtllm_mk/seam.py
//                                 params_layout_json): the plugin packs the kernel's parameters from
//                                 these offsets and reads its fault reports by these names
//   optional  "event_offsets"     object {event name: first flat counter index >= 0} (diagnostics)
//             "qk_norm", "qkv_bias"  booleans; when present the plugin insists on real tensors (or
//                                 on 1-element placeholders) for q_norm/k_norm, q/k/v_bias
//             "weight_bits"       16 (bf16, the default) or 4: how the kernel streams the decoder
//                                 layers' linear weights (4: trtllm_mk/quant/kernel_layout.py)
//   Any other key is skipped (it must still be valid JSON), so the builder may add keys first.
//   Duplicate keys, trailing data, non-integer numbers where integers are required are errors.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "seam_generated.h"

namespace trtllm_mk {

class KernelJsonError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// kernel.json "dims": one member per key of trtllm_mk/seam.py KERNEL_DIMS (L, H, I, V, NH, NKV, D, G, QKVR).
struct KernelDims {
#define TRTLLM_MK_DIM_MEMBER(key) int64_t key = 0;
  TRTLLM_MK_SEAM_KERNEL_DIMS(TRTLLM_MK_DIM_MEMBER)
#undef TRTLLM_MK_DIM_MEMBER
};

struct ParamField {
  std::string name;
  int64_t offset = 0, size = 0;
};

struct ParamsLayout {
  int64_t size = 0;
  std::vector<ParamField> fields;          // in struct order, non-overlapping, within size
  std::vector<std::string> layer_fields;   // mk::LayerWeights members in table order
  std::vector<std::string> error_fields;   // mk::ErrorInfo's 32-bit words in order
  std::vector<std::pair<std::string, int64_t>> error_codes;   // ErrorInfo.code values by name
  int64_t sampling_slot_bytes = 0;   // sizeof(mk::SamplingSlot); an all-zero slot is greedy
  int64_t max_top_logprobs = 0;
  int64_t cand_hist_bins = 0;

  // Index of ErrorInfo word `name`, or -1.
  int error_word(const std::string& name) const;
  // The code named `name`, or -1.
  int64_t error_code(const std::string& name) const;

  // The field named `name`, or nullptr.
  const ParamField* find(const std::string& name) const;
  // Writes `value` little-endian into `buf` (size bytes) at field `name`'s offset, truncated to its
  // size; throws KernelJsonError when the kernel has no such field.
  void put(std::vector<unsigned char>& buf, const std::string& name, uint64_t value) const;
};

struct KernelSpec {
  std::string kernel;
  std::string target;
  int64_t grid = 0, block = 0, smem_bytes = 0, num_counters = 0, n_lm_tiles = 0, history_len = 0,
          tokens_per_block = 0, batch = 0, attn_splits = 0;
  KernelDims dims;
  ParamsLayout params;
  std::vector<std::pair<std::string, int64_t>> event_offsets;  // sorted by offset; may be empty
  int qk_norm = -1;   // -1: not stated; 0/1: stated by the builder
  int qkv_bias = -1;
  int weight_bits = 16;   // 16: bf16 layer weights; 4: packed codes plus scale words (mk::LayerScales)

  // "<event>[+i]" for a flat counter index (for error reports), or "#<index>" without event_offsets.
  std::string event_name(uint64_t flat_index) const;
};

// Parses the text of a kernel.json; `where` names it in every error message.
KernelSpec parse_kernel_json(const std::string& text, const std::string& where);

// Reads and parses a file (at most 1 MiB: the real file is a few hundred bytes).
KernelSpec read_kernel_json(const std::string& path);

// The file's raw text (same size limit), e.g. to embed it in a serialized TensorRT engine.
std::string read_text_file(const std::string& path, size_t max_bytes);

}  // namespace trtllm_mk
