// Minimal strict JSON reader for kernel.json (see kernel_json.h for the schema and why it exists).
// It parses full JSON syntax (RFC 8259) into a small tree so that unknown keys can be skipped safely,
// but keeps only what the schema needs: integers exactly, other numbers only as "not an integer".
#include "kernel_json.h"

#include <algorithm>
#include <climits>
#include <fstream>
#include <map>
#include <sstream>

namespace trtllm_mk {
namespace {

constexpr size_t kMaxFileBytes = 1 << 20;
constexpr int kMaxDepth = 16;

struct JValue {
  enum Kind { kNull, kBool, kInt, kNumber, kString, kArray, kObject } kind = kNull;
  bool b = false;
  int64_t i = 0;
  std::string s;
  std::vector<JValue> arr;
  std::vector<std::pair<std::string, JValue>> obj;  // in file order; keys unique

  const JValue* get(const std::string& key) const {
    for (const auto& kv : obj)
      if (kv.first == key) return &kv.second;
    return nullptr;
  }
};

const char* kind_name(JValue::Kind k) {
  switch (k) {
    case JValue::kNull: return "null";
    case JValue::kBool: return "a boolean";
    case JValue::kInt: return "an integer";
    case JValue::kNumber: return "a non-integer number";
    case JValue::kString: return "a string";
    case JValue::kArray: return "an array";
    case JValue::kObject: return "an object";
  }
  return "?";
}

class Parser {
 public:
  Parser(const std::string& text, const std::string& where) : t_(text), where_(where) {}

  JValue document() {
    skip_ws();
    JValue v = value(0);
    skip_ws();
    if (p_ != t_.size()) fail("unexpected data after the top-level value");
    return v;
  }

 private:
  const std::string& t_;
  const std::string& where_;
  size_t p_ = 0;

  [[noreturn]] void fail(const std::string& what) const {
    size_t line = 1, col = 1;
    for (size_t k = 0; k < p_ && k < t_.size(); ++k) {
      if (t_[k] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    std::ostringstream os;
    os << where_ << ":" << line << ":" << col << ": invalid JSON: " << what;
    if (p_ >= t_.size()) os << " (the file ends here: truncated?)";
    throw KernelJsonError(os.str());
  }

  bool at_end() const { return p_ >= t_.size(); }
  char peek() const { return at_end() ? '\0' : t_[p_]; }

  void skip_ws() {
    while (!at_end() && (t_[p_] == ' ' || t_[p_] == '\t' || t_[p_] == '\n' || t_[p_] == '\r')) ++p_;
  }

  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++p_;
  }

  JValue value(int depth) {
    if (depth > kMaxDepth) fail("nesting deeper than 16 levels");
    if (at_end()) fail("unexpected end of file");
    const char c = peek();
    if (c == '{') return object(depth);
    if (c == '[') return array(depth);
    if (c == '"') {
      JValue v;
      v.kind = JValue::kString;
      v.s = string();
      return v;
    }
    if (c == '-' || (c >= '0' && c <= '9')) return number();
    if (literal("true")) return make_bool(true);
    if (literal("false")) return make_bool(false);
    if (literal("null")) return JValue{};
    fail(std::string("unexpected character '") + c + "'");
  }

  static JValue make_bool(bool b) {
    JValue v;
    v.kind = JValue::kBool;
    v.b = b;
    return v;
  }

  bool literal(const char* word) {
    const size_t n = std::char_traits<char>::length(word);
    if (t_.compare(p_, n, word) != 0) return false;
    p_ += n;
    return true;
  }

  JValue object(int depth) {
    JValue v;
    v.kind = JValue::kObject;
    expect('{');
    skip_ws();
    if (peek() == '}') {
      ++p_;
      return v;
    }
    while (true) {
      skip_ws();
      if (peek() != '"') fail("expected a string key");
      const size_t key_at = p_;
      std::string key = string();
      if (v.get(key) != nullptr) {
        p_ = key_at;
        fail("key \"" + key + "\" appears twice");
      }
      skip_ws();
      expect(':');
      skip_ws();
      JValue item = value(depth + 1);
      v.obj.emplace_back(std::move(key), std::move(item));
      skip_ws();
      if (peek() == ',') {
        ++p_;
        continue;
      }
      if (peek() == '}') {
        ++p_;
        return v;
      }
      fail("expected ',' or '}'");
    }
  }

  JValue array(int depth) {
    JValue v;
    v.kind = JValue::kArray;
    expect('[');
    skip_ws();
    if (peek() == ']') {
      ++p_;
      return v;
    }
    while (true) {
      skip_ws();
      v.arr.push_back(value(depth + 1));
      skip_ws();
      if (peek() == ',') {
        ++p_;
        continue;
      }
      if (peek() == ']') {
        ++p_;
        return v;
      }
      fail("expected ',' or ']'");
    }
  }

  unsigned hex4() {
    unsigned u = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = peek();
      unsigned d;
      if (c >= '0' && c <= '9') d = c - '0';
      else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
      else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
      else fail("bad \\u escape (needs 4 hex digits)");
      u = u * 16 + d;
      ++p_;
    }
    return u;
  }

  static void put_utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::string string() {
    expect('"');
    std::string out;
    while (true) {
      if (at_end()) fail("unterminated string");
      const unsigned char c = static_cast<unsigned char>(t_[p_]);
      if (c == '"') {
        ++p_;
        return out;
      }
      if (c < 0x20) fail("control character inside a string");
      if (c != '\\') {
        out += static_cast<char>(c);  // UTF-8 bytes pass through unchanged
        ++p_;
        continue;
      }
      ++p_;
      const char e = peek();
      ++p_;
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          unsigned cp = hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {  // high surrogate: a low one must follow
            if (!literal("\\u")) fail("unpaired UTF-16 surrogate in \\u escape");
            const unsigned lo = hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail("unpaired UTF-16 surrogate in \\u escape");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail("unpaired UTF-16 surrogate in \\u escape");
          }
          put_utf8(out, cp);
          break;
        }
        default: --p_; fail("unknown escape sequence");
      }
    }
  }

  JValue number() {
    const size_t start = p_;
    if (peek() == '-') ++p_;
    if (peek() == '0') {
      ++p_;
      if (peek() >= '0' && peek() <= '9') fail("leading zero in a number");
    } else if (peek() >= '1' && peek() <= '9') {
      while (peek() >= '0' && peek() <= '9') ++p_;
    } else {
      fail("bad number");
    }
    bool integral = true;
    if (peek() == '.') {
      integral = false;
      ++p_;
      if (!(peek() >= '0' && peek() <= '9')) fail("bad number (digits must follow '.')");
      while (peek() >= '0' && peek() <= '9') ++p_;
    }
    if (peek() == 'e' || peek() == 'E') {
      integral = false;
      ++p_;
      if (peek() == '+' || peek() == '-') ++p_;
      if (!(peek() >= '0' && peek() <= '9')) fail("bad number (digits must follow the exponent)");
      while (peek() >= '0' && peek() <= '9') ++p_;
    }
    JValue v;
    if (!integral) {
      v.kind = JValue::kNumber;
      return v;
    }
    // Exact conversion with an overflow check (strtoll would also accept things JSON does not).
    const bool neg = t_[start] == '-';
    uint64_t mag = 0;
    for (size_t k = start + (neg ? 1 : 0); k < p_; ++k) {
      const uint64_t d = static_cast<uint64_t>(t_[k] - '0');
      if (mag > (static_cast<uint64_t>(INT64_MAX) + (neg ? 1 : 0) - d) / 10) {
        p_ = start;
        fail("integer out of range");
      }
      mag = mag * 10 + d;
    }
    v.kind = JValue::kInt;
    v.i = neg ? static_cast<int64_t>(0 - mag) : static_cast<int64_t>(mag);
    return v;
  }
};

// Typed access with messages that name the key and say how to fix the file.
class Reader {
 public:
  explicit Reader(const std::string& where) : where_(where) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw KernelJsonError(where_ + ": " + what + "; rebuild the engine (python build_scripts/build_engine.py)");
  }

  const JValue& require(const JValue& obj, const std::string& key, const std::string& prefix) const {
    const JValue* v = obj.get(key);
    if (v == nullptr) fail("missing required key \"" + prefix + key + "\"");
    return *v;
  }

  int64_t integer(const JValue& obj, const std::string& key, int64_t minimum, const std::string& prefix = "") const {
    const JValue& v = require(obj, key, prefix);
    if (v.kind != JValue::kInt)
      fail("\"" + prefix + key + "\" must be an integer, got " + kind_name(v.kind));
    if (v.i < minimum || v.i > INT32_MAX) {
      std::ostringstream os;
      os << "\"" << prefix << key << "\" = " << v.i << " is out of range [" << minimum << ", " << INT32_MAX << "]";
      fail(os.str());
    }
    return v.i;
  }

  const JValue& object(const JValue& obj, const std::string& key, const std::string& prefix = "") const {
    const JValue& v = require(obj, key, prefix);
    if (v.kind != JValue::kObject) fail("\"" + prefix + key + "\" must be an object, got " + kind_name(v.kind));
    return v;
  }

  const JValue& array(const JValue& obj, const std::string& key, const std::string& prefix = "") const {
    const JValue& v = require(obj, key, prefix);
    if (v.kind != JValue::kArray) fail("\"" + prefix + key + "\" must be an array, got " + kind_name(v.kind));
    return v;
  }

  std::string string(const JValue& obj, const std::string& key, const std::string& prefix = "") const {
    const JValue& v = require(obj, key, prefix);
    if (v.kind != JValue::kString) fail("\"" + prefix + key + "\" must be a string, got " + kind_name(v.kind));
    if (v.s.empty()) fail("\"" + prefix + key + "\" must not be empty");
    return v.s;
  }

  int optional_bool(const JValue& obj, const std::string& key) const {
    const JValue* v = obj.get(key);
    if (v == nullptr) return -1;
    if (v->kind != JValue::kBool) fail("\"" + key + "\" must be true or false, got " + kind_name(v->kind));
    return v->b ? 1 : 0;
  }

 private:
  const std::string& where_;
};

ParamsLayout read_params(const Reader& r, const JValue& obj) {
  ParamsLayout p;
  p.size = r.integer(obj, "size", 8, "params.");
  const JValue& fields = r.array(obj, "fields", "params.");
  int64_t end = 0;
  for (size_t i = 0; i < fields.arr.size(); ++i) {
    const JValue& f = fields.arr[i];
    const std::string at = "params.fields[" + std::to_string(i) + "].";
    if (f.kind != JValue::kObject) r.fail("\"" + at.substr(0, at.size() - 1) + "\" must be an object");
    ParamField pf;
    pf.name = r.string(f, "name", at);
    pf.offset = r.integer(f, "offset", 0, at);
    pf.size = r.integer(f, "size", 1, at);
    if (pf.size != 4 && pf.size != 8) r.fail("\"" + at + "size\" must be 4 or 8");
    if (pf.offset < end || pf.offset % pf.size != 0 || pf.offset + pf.size > p.size)
      r.fail("\"" + at + "offset\" overlaps the previous field, is misaligned or lies beyond params.size");
    if (p.find(pf.name) != nullptr) r.fail("params field \"" + pf.name + "\" appears twice");
    end = pf.offset + pf.size;
    p.fields.push_back(pf);
  }
  const JValue& layer = r.array(obj, "layer_fields", "params.");
  for (size_t i = 0; i < layer.arr.size(); ++i) {
    if (layer.arr[i].kind != JValue::kString || layer.arr[i].s.empty())
      r.fail("\"params.layer_fields[" + std::to_string(i) + "]\" must be a non-empty string");
    p.layer_fields.push_back(layer.arr[i].s);
  }
  const JValue& err = r.array(obj, "error_fields", "params.");
  for (size_t i = 0; i < err.arr.size(); ++i) {
    if (err.arr[i].kind != JValue::kString || err.arr[i].s.empty())
      r.fail("\"params.error_fields[" + std::to_string(i) + "]\" must be a non-empty string");
    p.error_fields.push_back(err.arr[i].s);
  }
  if (p.error_word("code") != 0) r.fail("\"params.error_fields\" must start with \"code\"");
  const JValue* codes = obj.get("error_codes");
  if (codes == nullptr || codes->kind != JValue::kObject) r.fail("\"params.error_codes\" must be an object");
  for (const auto& kv : codes->obj) p.error_codes.emplace_back(kv.first, r.integer(*codes, kv.first, 1, "params.error_codes."));
  p.sampling_slot_bytes = r.integer(obj, "sampling_slot_bytes", 1, "params.");
  p.max_top_logprobs = r.integer(obj, "max_top_logprobs", 1, "params.");
  p.cand_hist_bins = r.integer(obj, "cand_hist_bins", 1, "params.");
  return p;
}

}  // namespace

int ParamsLayout::error_word(const std::string& name) const {
  for (size_t i = 0; i < error_fields.size(); ++i)
    if (error_fields[i] == name) return static_cast<int>(i);
  return -1;
}

int64_t ParamsLayout::error_code(const std::string& name) const {
  for (const auto& c : error_codes)
    if (c.first == name) return c.second;
  return -1;
}

const ParamField* ParamsLayout::find(const std::string& name) const {
  for (const auto& f : fields)
    if (f.name == name) return &f;
  return nullptr;
}

void ParamsLayout::put(std::vector<unsigned char>& buf, const std::string& name, uint64_t value) const {
  const ParamField* f = find(name);
  if (f == nullptr) throw KernelJsonError("kernel.json: the kernel's Params has no field \"" + name + "\"");
  if (buf.size() != static_cast<size_t>(size)) buf.assign(static_cast<size_t>(size), 0);
  for (int64_t b = 0; b < f->size; ++b) buf[static_cast<size_t>(f->offset + b)] = static_cast<unsigned char>(value >> (8 * b));
}

std::string KernelSpec::event_name(uint64_t flat_index) const {
  std::ostringstream os;
  const std::pair<std::string, int64_t>* best = nullptr;
  for (const auto& e : event_offsets)
    if (static_cast<uint64_t>(e.second) <= flat_index && (best == nullptr || e.second >= best->second)) best = &e;
  if (best == nullptr) {
    os << "#" << flat_index;
  } else {
    os << best->first << "[+" << (flat_index - static_cast<uint64_t>(best->second)) << "]";
  }
  return os.str();
}

KernelSpec parse_kernel_json(const std::string& text, const std::string& where) {
  if (text.size() > kMaxFileBytes) throw KernelJsonError(where + ": larger than 1 MiB; this is not a kernel.json");
  Parser parser(text, where);
  const JValue root = parser.document();
  Reader r(where);
  if (root.kind != JValue::kObject) r.fail(std::string("the top level must be an object, got ") + kind_name(root.kind));

  KernelSpec k;
  k.kernel = r.string(root, "kernel");
  k.target = r.string(root, "target");
  k.grid = r.integer(root, "grid", 1);
  k.block = r.integer(root, "block", 32);
  if (k.block % 32 != 0) r.fail("\"block\" = " + std::to_string(k.block) + " must be a multiple of 32 (whole warps)");
  k.smem_bytes = r.integer(root, "smem_bytes", 0);
  k.num_counters = r.integer(root, "num_counters", 1);
  k.n_lm_tiles = r.integer(root, "n_lm_tiles", 1);
  k.history_len = r.integer(root, "history_len", 1);
  k.tokens_per_block = r.integer(root, "tokens_per_block", 1);
  if (k.tokens_per_block & (k.tokens_per_block - 1))
    r.fail("\"tokens_per_block\" = " + std::to_string(k.tokens_per_block) + " must be a power of two");
  k.batch = r.integer(root, "batch", 1);
  k.attn_splits = r.integer(root, "attn_splits", 1);

  const JValue& dims = r.require(root, "dims", "");
  if (dims.kind != JValue::kObject) r.fail(std::string("\"dims\" must be an object, got ") + kind_name(dims.kind));
  KernelDims& d = k.dims;
#define TRTLLM_MK_READ_DIM(key) d.key = r.integer(dims, #key, 1, "dims.");
  TRTLLM_MK_SEAM_KERNEL_DIMS(TRTLLM_MK_READ_DIM)
#undef TRTLLM_MK_READ_DIM
  if (d.NH != d.NKV * d.G) r.fail("dims are inconsistent: NH != NKV * G");
  if (d.QKVR != d.NKV * (d.G + 2) * d.D) r.fail("dims are inconsistent: QKVR != NKV * (G + 2) * D");
  if (d.D % 2 != 0) r.fail("dims.D must be even (RoPE rotates pairs)");

  if (const JValue* ev = root.get("event_offsets")) {
    if (ev->kind != JValue::kObject) r.fail(std::string("\"event_offsets\" must be an object, got ") + kind_name(ev->kind));
    for (const auto& kv : ev->obj) {
      const int64_t off = r.integer(*ev, kv.first, 0, "event_offsets.");
      if (off >= k.num_counters) r.fail("\"event_offsets." + kv.first + "\" is beyond num_counters");
      k.event_offsets.emplace_back(kv.first, off);
    }
    std::sort(k.event_offsets.begin(), k.event_offsets.end(),
              [](const auto& a, const auto& b) { return a.second < b.second; });
  }
  k.params = read_params(r, r.object(root, "params"));
  k.qk_norm = r.optional_bool(root, "qk_norm");
  k.qkv_bias = r.optional_bool(root, "qkv_bias");
  if (root.get("weight_bits") != nullptr) {
    k.weight_bits = static_cast<int>(r.integer(root, "weight_bits", 4));
    if (k.weight_bits != 16 && k.weight_bits != 4)
      r.fail("\"weight_bits\" = " + std::to_string(k.weight_bits) + " must be 16 (bf16) or 4 (W4A16)");
  }
  return k;
}

std::string read_text_file(const std::string& path, size_t max_bytes) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw KernelJsonError(path + ": cannot open (is this an engine directory built by trtllm_mk?)");
  std::string text;
  char buf[4096];
  while (f.read(buf, sizeof(buf)) || f.gcount() > 0) {
    text.append(buf, static_cast<size_t>(f.gcount()));
    if (text.size() > max_bytes) throw KernelJsonError(path + ": unexpectedly large (over " +
                                                       std::to_string(max_bytes) + " bytes)");
  }
  if (f.bad()) throw KernelJsonError(path + ": read error");
  return text;
}

KernelSpec read_kernel_json(const std::string& path) {
  return parse_kernel_json(read_text_file(path, kMaxFileBytes), path);
}

}  // namespace trtllm_mk
